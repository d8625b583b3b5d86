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
    "llama3_rope": ("LlamaConfig", dict(
        head_dim=16, tie_word_embeddings=True,
        # original context 64: wavelengths span all three llama3 bands (kept, smoothed, divided by factor)
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=32, tie_word_embeddings=False)),
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


def build_tiny_model(path: Path, name: str, tokenizer_dir: Path | None = None, seed: int = 0,
                     max_shard_size: str | None = None, **config_overrides: Any) -> Path:
    """Write tiny random model ``name`` to ``path``: config, fp32 safetensors (sharded if asked), tokenizer."""
    from transformers import AutoTokenizer

    model = make_tiny_model(name, seed, **config_overrides)
    model.save_pretrained(path, safe_serialization=True,
                          **({"max_shard_size": max_shard_size} if max_shard_size else {}))
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
def hf_greedy(model: Any, prompts_token_ids: Sequence[Sequence[int]], max_new_tokens: int,
              topk: int = 5) -> list[GreedyResult]:
    """transformers greedy decoding, never stopping at EOS, with raw top-``topk`` logprobs per step.

    ``model`` is a loaded ``PreTrainedModel`` or a directory to load one from (float32).
    Logprobs are ``log_softmax`` of the raw logits (vLLM's ``raw_logprobs``).
    """
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    device = next(model.parameters()).device
    results = []
    for ids in prompts_token_ids:
        assert len(ids) > 0, "hf_greedy needs a non-empty prompt"
        out = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=True, logits_to_keep=1)
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
                out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values,
                            use_cache=True, logits_to_keep=1)
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


def check_greedy_close(ref: Sequence[_Generation], ours: Sequence[_Generation], topk: int, *,
                       logprob_atol: float = 1e-3, min_exact_fraction: float = 0.5,
                       max_divergence_gap: float | None = None,
                       names: tuple[str, str] = ("ref", "ours")) -> GreedyComparison:
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
        assert len(a.logprobs) == len(a_ids) and len(b.logprobs) == len(b_ids), \
            f"sequence {i}: one logprobs dict per generated token is required"
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
                    failures.append(f"sequence {i} pos {pos}: token {ta} logprob {ref_name}={_lp(la[ta]):.6f} "
                                    f"{our_name}={_lp(lb[tb]):.6f} (|diff| {diff:.2e} > {logprob_atol:g})")
                continue
            diverged_at = pos
            context = (f"sequence {i} diverges at pos {pos}: {ref_name} chose {ta}, {our_name} chose {tb}; "
                       f"{ref_name} top-{topk} {_fmt(la)}, {our_name} top-{topk} {_fmt(lb)}")
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
        failures.append(f"only {result.num_exact}/{len(ref)} sequences match exactly, need {needed} "
                        f"(first divergences: {divergence})")
    assert not failures, "\n".join(failures)
    return result


def _fmt(step: Mapping[int, Any]) -> str:
    return "{" + ", ".join(f"{t}: {_lp(v):.4f}" for t, v in sorted(step.items(), key=lambda kv: -_lp(kv[1]))) + "}"


# -- a live server ---------------------------------------------------------------------

MODEL = "tiny"  # the served model name of test servers


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Return once ``url``/health answers 200; raise if the server exits or never gets there."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
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

    def __init__(self, model_dir: str, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir, "--port", str(self.port),
               "--served-model-name", MODEL, "--max-model-len", "256", "--num-gpu-blocks-override", "128",
               "--uvicorn-log-level", "warning", *extra]
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
