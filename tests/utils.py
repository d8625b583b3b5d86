"""Shared helpers for tests that compare pagedllm's output with a reference.

``hf_greedy`` is the oracle: transformers' own model, one prompt at a time (no
padding), decoded greedily by hand so no generation-config logits processor
can interfere. ``check_greedy_close`` is the project's rule for comparing two
greedy runs (vLLM's ``check_logprobs_close``, plus logprob agreement and a
floor on exact matches so a broken engine cannot pass by diverging early).

Both sides are anything with ``.token_ids`` and ``.logprobs`` (one dict per
generated token, token id -> float or :class:`pagedllm.outputs.Logprob`):
``GreedyResult`` from ``hf_greedy`` or pagedllm's ``CompletionOutput``.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

# -- tiny random-weight models ---------------------------------------------------------

TINY_VOCAB_SIZE = 49152  # SmolLM2's tokenizer

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# name -> (transformers config class name, config fields on top of _COMMON)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(head_dim=32, tie_word_embeddings=False)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            head_dim=16,
            tie_word_embeddings=True,
            # original context 64: wavelengths span all three llama3 bands (kept, smoothed, divided by factor)
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=32, tie_word_embeddings=False)),
    # Mixture of Experts: 8 experts, 2 per token (renormalised); Qwen2-MoE with a shared expert and raw
    # top-k weights; Qwen3-MoE renormalised, with a dense layer 0 (mlp_only_layers)
    "mixtral": (
        "MixtralConfig",
        dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3: a local (sliding, own RoPE base) and a global layer, query_pre_attn_scalar != head_dim, soft-capped
    # logits; its norms scale by 1 + weight, and the random weights above are that weight
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            sliding_window=32,
            query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
}
TINY_MODEL_NAMES = list(TINY_MODELS)


def make_tiny_model(name: str, seed: int = 0, **config_overrides: Any) -> Any:
    """Tiny random transformers model ``name`` (a key of TINY_MODELS), in float32."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, fields = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**{**_COMMON, **fields, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # RMSNorm weights (q/k norms included) away from the all-ones init
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def build_tiny_model(
    path: Path,
    name: str,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    eagle_friendly: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write tiny random model ``name`` to ``path``: config, fp32 safetensors (sharded if asked), tokenizer.

    ``eagle_friendly``: embedding rows scaled to RMS 1 and the RMSNorm weights set to 1, so a one-layer
    model's layer-0 input norm is the identity (as an EAGLE head's is) and its final norm only scales
    each row: an EAGLE head holding a copy of its layer then predicts what it predicts (see
    :func:`build_spec_head`).
    """
    from transformers import AutoTokenizer

    model = make_tiny_model(name, seed, **config_overrides)
    if eagle_friendly:
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
            for pname, p in model.named_parameters():
                if pname.endswith("layernorm.weight") or pname == "model.norm.weight":
                    p.fill_(1.0)
    model.save_pretrained(
        path, safe_serialization=True, **({"max_shard_size": max_shard_size} if max_shard_size else {})
    )
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


class GreedyResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per step: the top-k tokens plus the chosen one


class _Generation(Protocol):
    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, Any]] | None


@torch.inference_mode()
def hf_greedy(
    model: Any,
    prompts_token_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    topk: int = 5,
    first_inputs: Sequence[dict[str, Any]] | None = None,
) -> list[GreedyResult]:
    """transformers greedy decoding, never stopping at EOS, with raw top-``topk`` logprobs per step.

    ``model`` is a loaded ``PreTrainedModel`` or a directory to load one from (float32).
    Logprobs are ``log_softmax`` of the raw logits (vLLM's ``raw_logprobs``). ``first_inputs``: per prompt,
    more inputs of the prompt's forward pass (a vision-language model's ``pixel_values``).
    """
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    device = next(model.parameters()).device
    results = []
    for i, ids in enumerate(prompts_token_ids):
        assert len(ids) > 0, "hf_greedy needs a non-empty prompt"
        extra = first_inputs[i] if first_inputs is not None else {}
        if getattr(getattr(model, "model", None), "rope_deltas", None) is not None:
            model.model.rope_deltas = None  # Qwen2-VL keeps the last prompt's M-RoPE delta for its decode steps
        out = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=True, logits_to_keep=1, **extra)
        tokens: list[int] = []
        steps: list[dict[int, float]] = []
        for step in range(max_new_tokens):
            logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(logprobs.argmax())
            top_lp, top_ids = logprobs.topk(topk)
            entry = dict(zip(top_ids.tolist(), top_lp.tolist()))
            entry[token] = float(logprobs[token])
            tokens.append(token)
            steps.append(entry)
            if step + 1 < max_new_tokens:
                out = model(
                    input_ids=torch.tensor([[token]], device=device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                    logits_to_keep=1,
                )
        results.append(GreedyResult(tokens, steps))
    return results


@dataclass(slots=True)
class GreedyComparison:
    """What ``check_greedy_close`` saw: per sequence, the first divergent position (None: exact match)."""

    divergence: list[int | None]
    max_logprob_diff: float  # over every compared (matching) position

    @property
    def num_exact(self) -> int:
        return sum(d is None for d in self.divergence)


def _lp(entry: Any) -> float:
    return float(getattr(entry, "logprob", entry))


def _top_k_ids(step: Mapping[int, Any], k: int) -> set[int]:
    """The k most likely ids of one step's dict (which may also hold a sampled token outside the top-k)."""
    return {t for t, _ in sorted(step.items(), key=lambda kv: -_lp(kv[1]))[:k]}


def check_greedy_close(
    ref: Sequence[_Generation],
    ours: Sequence[_Generation],
    topk: int,
    *,
    logprob_atol: float = 1e-3,
    min_exact_fraction: float = 0.5,
    max_divergence_gap: float | None = None,
    names: tuple[str, str] = ("ref", "ours"),
) -> GreedyComparison:
    """Assert two greedy runs agree, allowing a divergence only where the two tokens are near-tied.

    Per sequence, positions are compared in order:

    * while the tokens match, the chosen token's logprob must agree within ``logprob_atol``;
    * at the first mismatch, each side's token must be in the other side's top-``topk``
      (and, if ``max_divergence_gap`` is given, within that many nats of the other side's
      choice in both distributions); the rest of the sequence is then not compared;
    * sequences of different lengths fail unless they diverged first.

    At least ``min_exact_fraction`` of the sequences must match exactly, so an
    engine whose every output diverges at token 0 fails even when each of those
    tokens happens to lie in the reference's top-k.
    """
    ref_name, our_name = names
    assert len(ref) == len(ours), f"{len(ref)} {ref_name} sequences vs {len(ours)} {our_name} sequences"
    failures: list[str] = []
    divergence: list[int | None] = []
    max_diff = 0.0
    for i, (a, b) in enumerate(zip(ref, ours)):
        a_ids, b_ids = list(a.token_ids), list(b.token_ids)
        if a.logprobs is None or b.logprobs is None:
            raise AssertionError(f"sequence {i}: both sides need per-token logprobs (SamplingParams(logprobs=k))")
        assert len(a.logprobs) == len(a_ids) and len(b.logprobs) == len(b_ids), (
            f"sequence {i}: one logprobs dict per generated token is required"
        )
        diverged_at = None
        for pos, (ta, tb) in enumerate(zip(a_ids, b_ids)):
            la, lb = a.logprobs[pos], b.logprobs[pos]
            if ta == tb:
                if ta not in la or ta not in lb:
                    failures.append(f"sequence {i} pos {pos}: chosen token {ta} missing from a logprobs dict")
                    diverged_at = pos
                    break
                diff = abs(_lp(la[ta]) - _lp(lb[tb]))
                max_diff = max(max_diff, diff)
                if not diff <= logprob_atol:  # `not <=` also catches NaN
                    failures.append(
                        f"sequence {i} pos {pos}: token {ta} logprob {ref_name}={_lp(la[ta]):.6f} "
                        f"{our_name}={_lp(lb[tb]):.6f} (|diff| {diff:.2e} > {logprob_atol:g})"
                    )
                continue
            diverged_at = pos
            context = (
                f"sequence {i} diverges at pos {pos}: {ref_name} chose {ta}, {our_name} chose {tb}; "
                f"{ref_name} top-{topk} {_fmt(la)}, {our_name} top-{topk} {_fmt(lb)}"
            )
            if tb not in _top_k_ids(la, topk) or ta not in _top_k_ids(lb, topk):
                failures.append(context + ": each token must be in the other side's top-k")
            elif max_divergence_gap is not None:
                gap = max(_lp(la[ta]) - _lp(la[tb]), _lp(lb[tb]) - _lp(lb[ta]))
                if not gap <= max_divergence_gap:
                    failures.append(context + f": not a near-tie (gap {gap:.2e} > {max_divergence_gap:g})")
            break
        if diverged_at is None and len(a_ids) != len(b_ids):
            diverged_at = min(len(a_ids), len(b_ids))
            failures.append(f"sequence {i}: {ref_name} has {len(a_ids)} tokens, {our_name} {len(b_ids)}")
        divergence.append(diverged_at)
    result = GreedyComparison(divergence, max_diff)
    needed = math.ceil(min_exact_fraction * len(ref))
    if result.num_exact < needed:
        failures.append(
            f"only {result.num_exact}/{len(ref)} sequences match exactly, need {needed} "
            f"(first divergences: {divergence})"
        )
    assert not failures, "\n".join(failures)
    return result


def _fmt(step: Mapping[int, Any]) -> str:
    return "{" + ", ".join(f"{t}: {_lp(v):.4f}" for t, v in sorted(step.items(), key=lambda kv: -_lp(kv[1]))) + "}"


# -- a live server ---------------------------------------------------------------------

MODEL = "tiny"  # the served model name of test servers


def noise_image(seed: int, size: tuple[int, int]) -> Any:
    """A PIL RGB image of seeded uniform noise, ``size`` = (height, width)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def image_chat_batch(image_part: str, images: Sequence[Any]) -> list[tuple[str, list[Any]]]:
    """(ChatML prompt, its images): text-only prompts beside prompts of 1 to 3 of ``images`` (5 of them), one
    image twice; ``image_part`` is where each image goes in the family's prompt."""

    def chat(num_images: int, question: str) -> str:
        return f"<|im_start|>user\n{image_part * num_images}{question}<|im_end|>\n<|im_start|>assistant\n"

    return [
        (chat(1, "What is in this picture?"), [images[0]]),
        (chat(0, "Write a haiku about the sea."), []),
        (chat(2, "Compare these two pictures."), [images[1], images[2]]),
        (chat(3, "Describe all three in one line each."), [images[3], images[4], images[0]]),
        ("Once upon a time", []),
        (chat(1, "Is this the same picture as before?"), [images[2]]),
    ]


def check_engine_clean(llm: Any) -> None:
    """The scheduler's invariants hold and every KV block is free again (nothing left running)."""
    s = llm.llm_engine.core.scheduler
    s.check_invariants()
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def check_outputs_unchanged(reference: Sequence[Any], outs: Sequence[Any], topk: int = 5) -> None:
    """``outs`` (RequestOutputs, greedy, with logprobs) equal ``reference``'s: a scheduler feature on vs off."""
    check_greedy_close(
        [o.outputs[0] for o in reference],
        [o.outputs[0] for o in outs],
        topk,
        logprob_atol=1e-4,
        min_exact_fraction=1.0,
        names=("off", "on"),
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120, path: str = "/health") -> None:
    """Return once ``url`` + ``path`` answers 200; raise if the server exits or never gets there."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            if httpx.get(f"{url}{path}", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not become healthy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`pagedllm serve` on a tiny model in a subprocess, on a free loopback port; healthy on return."""

    def __init__(self, model_dir: str, *extra: str, port: int | None = None, host: str = "127.0.0.1", prefix=()):
        """``host``: the address it listens on; ``prefix``: what runs the command (``ip netns exec NS``)."""
        self.port = port or _free_port()
        self.url = f"http://{host}:{self.port}"
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            model_dir,
            "--host",
            host,
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "256",
            "--num-gpu-blocks-override",
            "128",
            "--uvicorn-log-level",
            "warning",
            *extra,
        ]
        # a file, not a pipe: a pipe nobody reads would block the server once its logs fill it
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(self.url, self.proc)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}: {self.output()[-3000:]}") from None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str) -> float:
        import httpx

        text = httpx.get(f"{self.url}/metrics").text
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode


# -- speculative-decoding heads in their published layouts ------------------------------


def build_spec_head(
    path: Path,
    kind: str,
    target_dir: Path | None,
    seed: int = 0,
    noise: float = 0.2,
    layout: str = "vllm",
    fmt: str = "safetensors",
    target_cfg: dict | None = None,
) -> Path:
    """A tiny random head for the tiny target in ``target_dir``, written as the published checkpoints are.

    ``kind``: ``eagle`` (SafeAILab EAGLE: ``fc`` + ``layers.0`` without input norm), ``eagle3``
    (``midlayer.*``, ``fc`` over three aux states, ``norm``, a 1024-token draft ``lm_head`` + ``d2t`` /
    ``t2d``) or ``medusa`` (``layout="vllm"``: ``blocks.{i}.layers.{j}`` / ``lm_heads.{i}``;
    ``layout="original"``: FasterDecoding's ``{i}.{j}.linear`` / ``{i}.{L}``). The EAGLE head copies the
    layer of a one-layer ``eagle_friendly`` target, so its drafts are mostly right; the EAGLE-3 and
    MEDUSA heads are random. ``fmt="bin"`` writes ``pytorch_model.bin`` instead. ``target_cfg`` gives the
    target's sizes where it has no config.json (a GGUF).
    """
    import json

    from safetensors.torch import save_file

    target_cfg = target_cfg or json.loads((target_dir / "config.json").read_text())
    h, v = target_cfg["hidden_size"], target_cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = noise) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    path.mkdir(parents=True, exist_ok=True)
    w: dict[str, torch.Tensor] = {}
    if kind in ("eagle", "eagle3"):
        heads, kv_heads, hd, inter = (
            target_cfg["num_attention_heads"],
            target_cfg["num_key_value_heads"],
            target_cfg.get("head_dim") or h // target_cfg["num_attention_heads"],
            target_cfg["intermediate_size"],
        )
        cfg = dict(
            architectures=["LlamaForCausalLM" if kind == "eagle" else "LlamaForCausalLMEagle3"],
            model_type="llama",
            hidden_size=h,
            intermediate_size=inter,
            num_hidden_layers=1,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hd,
            vocab_size=v,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            rope_theta=10000.0,
            hidden_act="silu",
        )
        p = "layers.0." if kind == "eagle" else "midlayer."
        width = h if kind == "eagle" else 2 * h
        w[p + "self_attn.q_proj.weight"] = rnd(heads * hd, width)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * hd, width)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * hd, width)
        w[p + "self_attn.o_proj.weight"] = rnd(h, heads * hd, std=noise / 4)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter, std=noise / 4)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(h, std=0.1)
        if kind == "eagle":  # fc([embedding of p+1, features at p]) = the embedding, and the target's own layer:
            # on a one-layer eagle_friendly target its output at p is the target's state at p+1 (but for the
            # first token, which the head never sees), so its drafts are mostly right
            from safetensors.torch import load_file

            target = load_file(str(target_dir / "model.safetensors"))
            for name in list(w):
                w[name] = target["model." + name].clone()
            w["fc.weight"] = torch.cat([torch.eye(h), rnd(h, h, std=noise / 10)], 1)
            w["fc.bias"] = rnd(h, std=noise / 10)
        else:
            draft_vocab = 1024
            cfg.update(draft_vocab_size=draft_vocab)
            kept = torch.randperm(v, generator=g)[:draft_vocab].sort().values
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[kept] = True
            w.update(
                {
                    "fc.weight": rnd(h, 3 * h),
                    "midlayer.input_layernorm.weight": 1 + rnd(h, std=0.1),
                    "midlayer.hidden_norm.weight": 1 + rnd(h, std=0.1),
                    "norm.weight": 1 + rnd(h, std=0.1),
                    "lm_head.weight": rnd(draft_vocab, h, std=1.0),
                    "d2t": kept - torch.arange(draft_vocab),
                    "t2d": t2d,
                }
            )
    elif kind == "medusa":
        num_heads, num_layers = 4, 1
        for i in range(num_heads):
            for j in range(num_layers):
                lin = "linear." if layout == "original" else ""
                blk = f"{i}.{j}." if layout == "original" else f"blocks.{i}.layers.{j}."
                w[f"{blk}{lin}weight"] = rnd(h, h, std=noise / 4)
                w[f"{blk}{lin}bias"] = rnd(h, std=noise / 4)
            w[f"{i}.{num_layers}.weight" if layout == "original" else f"lm_heads.{i}.weight"] = rnd(v, h, std=1.0)
        cfg = (
            dict(medusa_num_heads=num_heads, medusa_num_layers=num_layers, base_model_name_or_path="tiny")
            if layout == "original"
            else dict(
                architectures=["MedusaModel"],
                model_type="medusa",
                hidden_size=h,
                vocab_size=v,
                num_heads=num_heads,
                num_hidden_layers=num_layers,
                truncated_vocab_size=None,
            )
        )
    else:
        raise ValueError(kind)
    (path / "config.json").write_text(json.dumps(cfg))
    w = {k: t.contiguous() for k, t in w.items()}
    if fmt == "bin":
        torch.save(w, path / "pytorch_model.bin")
    else:
        save_file(w, str(path / "model.safetensors"))
    return path


# -- function tools in chat's shape (the Responses API tests flatten them) ------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]},
    },
}


def real_models_module() -> Any:
    """``benchmarks/real_models.py`` (not a package) as a module: the real models' registry, fetch and verify."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "real_models.py"
    spec = importlib.util.spec_from_file_location("real_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_models"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def benchmark_module(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (it imports ``real_models`` and its other neighbours, as when it runs
    with its folder on sys.path: the folder goes at the end of sys.path, shadowing nothing)."""
    import importlib.util

    if "real_models" not in sys.modules:
        real_models_module()
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if folder not in sys.path:
        sys.path.append(folder)
    path = Path(folder) / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schemathesis(url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``schemathesis run`` of the server at ``url``'s /openapi.json, deterministic, with ``args`` (checks, paths,
    headers) added; its output is text."""
    st = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    return subprocess.run(
        [st, "run", f"{url}/openapi.json", "--generation-deterministic", "--request-timeout", "60", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )


@contextmanager
def kernels_at(level: str):
    """pagedllm's C kernels built for instruction-set ``level`` (``$PAGEDLLM_CPU_LEVEL``; cached as any build is),
    loaded in place of the machine's own for the block, then put back."""
    import pytest

    from pagedllm import kernels
    from pagedllm.kernels import isa

    if level == kernels.load().level:
        yield kernels.load()
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(isa.ENV, level)
        kernels.load.cache_clear(), kernels.try_load.cache_clear()
        try:
            assert kernels.load().level == level
            yield kernels.load()
        finally:
            kernels.load.cache_clear(), kernels.try_load.cache_clear()
    assert kernels.load().level != level


def assert_fast_gguf_config_is_transformers_own(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Our reading of a GGUF's config metadata (gguf_config_dict) equals transformers' legacy (full-parse) reading;
    returns it."""
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedllm.model_loader.gguf_loader import gguf_config_dict

    fast = gguf_config_dict(*read_gguf_metadata(str(path)))
    assert fast == load_gguf_checkpoint(str(path))["config"]
    return fast
