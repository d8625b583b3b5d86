"""EAGLE, EAGLE-3 and MEDUSA heads: tiny random heads in the published layouts, made here.

Three things are shown. Outputs are unchanged with a head drafting (greedy and
seeded sampling, chunked prefill, prefix caching, preemption, n>1). The drafts the
engine proposes, step after step, are exactly the ones a dense re-implementation of
each head (transformers' attention, rotary and MLP modules, fed transformers' own
hidden states of the target) computes from the same tokens. So the paged catch-up,
the rollback after rejections and the hidden-state plumbing are right, not only
harmless. And a head that can predict (an EAGLE head holding a copy of a one-layer
target's layer) gets many drafts accepted.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_spec_decode import _generate, _mixed_params, _spec_stats

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError

from utils import build_spec_head

PROMPTS = [
    "The river town",
    "def add(a, b):\n    return a + b\n" * 3,
    "one two three four five six seven",
    "A" * 40,
    "def add(a, b):\n    return a + b\n" * 3 + "def",
]


@pytest.fixture(scope="module")
def targets(tiny_model_factory):
    """A one-layer eagle_friendly target (for the EAGLE head that copies its layer) and a four-layer one
    (EAGLE-3 reads the inputs of its layers 2, 2 and 1: vLLM's default 2, L/2, L-3)."""
    return {
        "eagle": tiny_model_factory("llama", num_hidden_layers=1, eagle_friendly=True),
        "eagle3": tiny_model_factory("llama", num_hidden_layers=4),
        "medusa": tiny_model_factory("llama", num_hidden_layers=4),
    }


@pytest.fixture(scope="module")
def heads(targets, module_tmp):
    root = module_tmp("heads")
    return {
        "eagle": build_spec_head(root / "eagle", "eagle", targets["eagle"], noise=0.005),
        "eagle_random": build_spec_head(root / "eagle_random", "eagle", targets["eagle"], noise=0.2, fmt="bin"),
        "eagle3": build_spec_head(root / "eagle3", "eagle3", targets["eagle3"]),
        "medusa": build_spec_head(root / "medusa", "medusa", targets["medusa"]),
    }


def _spec(method: str, head, k: int = 3) -> dict:
    """Drafting at every step, whether drafts are accepted and whatever this machine's speed says they cost."""
    return {
        "method": method,
        "model": str(head),
        "num_speculative_tokens": k,
        "backoff_after_rejections": 0,
        "backoff_by_cost": False,
    }


SETTINGS = {
    "default": {},
    "chunked_small_budget": {"max_num_batched_tokens": 24},
    "small_cache_preemption": {"num_gpu_blocks_override": 12, "max_model_len": 128},
}


@pytest.mark.parametrize(
    "method,setting",
    [
        ("eagle", "default"),
        ("eagle", "chunked_small_budget"),
        ("eagle", "small_cache_preemption"),
        ("eagle3", "chunked_small_budget"),
        ("eagle3", "small_cache_preemption"),
        ("medusa", "default"),
        ("medusa", "small_cache_preemption"),
    ],
)
def test_outputs_identical_with_a_head_drafting(targets, heads, method, setting):
    target = targets[method]
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 128, **SETTINGS[setting]}
    prompts = PROMPTS
    params = _mixed_params()
    want = _generate(LLM(str(target), **kw), prompts, params)
    llm = LLM(str(target), speculative_config=_spec(method, heads[method]), **kw)
    assert _generate(llm, prompts, params) == want
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    if method == "eagle":  # the head that copies the target's layer guesses the greedy continuation: about
        # half its drafts are right for greedy rows, few for the rows sampled at temperature ~1
        assert stats.num_accepted_tokens > 0.04 * stats.num_draft_tokens
    sched = llm.llm_engine.core.scheduler
    if setting == "small_cache_preemption":
        assert sched.num_preemptions > 0
    sched.check_invariants()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen2"])
def test_other_families_with_heads(tiny_model_factory, tmp_path, family):
    """EAGLE-3 (the aux states of a Qwen / Mistral target) and MEDUSA on the other tiny families."""
    target = tiny_model_factory(family, num_hidden_layers=4)
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 64, "max_num_batched_tokens": 32}
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.8, seed=2)]
    want = _generate(LLM(str(target), **kw), PROMPTS[1:3], params)
    for method in ("eagle3", "medusa"):
        head = build_spec_head(tmp_path / method, method, target)
        llm = LLM(str(target), speculative_config=_spec(method, head), **kw)
        assert _generate(llm, PROMPTS[1:3], params) == want, method
        assert _spec_stats(llm).num_draft_tokens > 0


SMOLLM2 = dict(
    hidden_size=576, vocab_size=49152, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536
)


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_smollm2_outputs_identical_with_a_head(tmp_path, method):
    """The embedded GGUF model (30 layers: EAGLE-3 reads the inputs of layers 2, 15 and 27) with a random head."""
    head = build_spec_head(tmp_path / method, method, None, target_cfg=SMOLLM2)
    kw = {"max_model_len": 192, "max_num_batched_tokens": 32}
    prompts = PROMPTS[1:3]
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.8, seed=1, n=2)]
    want = _generate(LLM(**kw), prompts, params)
    llm = LLM(speculative_config=_spec(method, head), **kw)
    assert _generate(llm, prompts, params) == want
    if method == "eagle3":
        assert llm.llm_engine.core.runner.model.aux_hidden_state_layers == (2, 15, 27)
    assert _spec_stats(llm).num_draft_tokens > 0


# -- the drafts themselves, against a dense reference --------------------------------------


class _DenseHead:
    """EAGLE / EAGLE-3 / MEDUSA recomputed densely from the checkpoint files with transformers' modules."""

    def __init__(self, method: str, head_dir, target_dir):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaMLP,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        self.method = method
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        files = list(head_dir.glob("*.safetensors"))
        sd = load_file(str(files[0])) if files else torch.load(head_dir / "pytorch_model.bin", weights_only=True)
        self.sd = sd
        if method == "medusa":
            return
        cfg = LlamaConfig.from_pretrained(head_dir)
        cfg._attn_implementation = "eager"
        h = cfg.hidden_size
        self.attn, self.mlp = LlamaAttention(cfg, 0), LlamaMLP(cfg)
        self.post_norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(cfg)
        p = "layers.0." if method == "eagle" else "midlayer."
        if method == "eagle3":
            a = self.attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(a, name)
                setattr(a, name, torch.nn.Linear(2 * h, old.out_features, bias=False))
            self.in_norm, self.hid_norm, self.norm = (LlamaRMSNorm(h, cfg.rms_norm_eps) for _ in range(3))
            self.in_norm.weight.data = sd[p + "input_layernorm.weight"]
            self.hid_norm.weight.data = sd[p + "hidden_norm.weight"]
            self.norm.weight.data = sd["norm.weight"]
        self.attn.load_state_dict(
            {k.removeprefix(p + "self_attn."): v for k, v in sd.items() if k.startswith(p + "self_attn.")}
        )
        self.mlp.load_state_dict({k.removeprefix(p + "mlp."): v for k, v in sd.items() if k.startswith(p + "mlp.")})
        self.post_norm.weight.data = sd[p + "post_attention_layernorm.weight"]
        self.aux_layers = (2, 2, 1)

    @torch.inference_mode()
    def features(self, ids: list[int]) -> torch.Tensor:
        """The target's features at each position: its final hidden state, or EAGLE-3's fused aux states."""
        seen = {}
        hooks = (
            [
                self.target.model.layers[i].register_forward_pre_hook(
                    lambda mod, args, i=i: seen.__setitem__(i, args[0][0])
                )
                for i in (2, 1)
            ]
            if self.method == "eagle3"
            else []
        )
        final = self.target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        for hook in hooks:
            hook.remove()
        if self.method == "eagle3":
            return torch.cat([seen[i] for i in self.aux_layers], -1) @ self.sd["fc.weight"].T
        return final

    @torch.inference_mode()
    def _run(self, next_tokens: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(next_tokens)
        emb = self.target.model.embed_tokens(torch.tensor(next_tokens))
        cos_sin = self.rotary(emb[None], torch.arange(n)[None])
        mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
        if self.method == "eagle":
            x = torch.cat([emb, feats], -1) @ self.sd["fc.weight"].T + self.sd["fc.bias"]
            res = x
        else:
            res = feats
            x = torch.cat([self.in_norm(emb), self.hid_norm(feats)], -1)
        x = self.attn(x[None], cos_sin, mask)[0][0] + res
        x = self.mlp(self.post_norm(x)) + x
        return (x, x) if self.method == "eagle" else (self.norm(x), x)

    def _token(self, h: torch.Tensor) -> int:
        if self.method == "eagle":
            return int(self.target.lm_head(h).argmax())
        i = int((h @ self.sd["lm_head.weight"].T).argmax())
        return i + int(self.sd["d2t"][i])

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the head proposes once ``tokens`` are known (the last one just sampled)."""
        c = len(tokens) - 1
        feats = self.features(tokens[:c])
        if self.method == "medusa":
            out = []
            for i in range(k):
                x = feats[-1]
                x = x + torch.nn.functional.silu(
                    x @ self.sd[f"blocks.{i}.layers.0.weight"].T + self.sd[f"blocks.{i}.layers.0.bias"]
                )
                out.append(int((x @ self.sd[f"lm_heads.{i}.weight"].T).argmax()))
            return out
        nxt = list(tokens[1 : c + 1])
        out = []
        for _ in range(k):
            for_logits, hidden = self._run(nxt, feats)
            out.append(self._token(for_logits[-1]))
            nxt.append(out[-1])
            feats = torch.cat([feats, hidden[-1:]])
        return out


@pytest.mark.parametrize("method", ["eagle", "eagle_random", "eagle3", "medusa"])
def test_drafts_match_a_dense_reference(targets, heads, method):
    """Chunked prefill (prompt catch-up over several chunks), accepted and rejected drafts: every proposal
    the engine makes equals the dense head's for the same tokens."""
    base = method.removesuffix("_random")
    k = 3
    llm = LLM(
        str(targets[base]),
        max_model_len=256,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        speculative_config=_spec(base, heads[method], k),
    )
    proposer = llm.llm_engine.core.runner.proposer
    seen: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    def recording(ctx):
        out = original(ctx)
        seen.extend((list(ctx.states[rid].token_ids), d) for rid, d in out.items())
        return out

    proposer.propose = recording
    llm.generate(PROMPTS[1:3], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert len(seen) >= 16
    ref = _DenseHead(base, heads[method], targets[base])
    mismatched = [(tokens[-3:], got, ref.drafts(tokens, len(got))) for tokens, got in seen]
    mismatched = [m for m in mismatched if m[1] != m[2]]
    assert not mismatched, mismatched[:3]
    if method == "eagle":
        assert _spec_stats(llm).num_accepted_tokens > 0  # the multi-token catch-up after acceptance ran


# -- loading and bad input --------------------------------------------------------------


def test_medusa_original_layout_loads_the_same_heads(targets, tmp_path):
    from pagedllm.models.spec_heads import load_spec_head

    vllm_dir = build_spec_head(tmp_path / "v", "medusa", targets["medusa"], seed=3)
    orig_dir = build_spec_head(tmp_path / "o", "medusa", targets["medusa"], seed=3, layout="original", fmt="bin")
    target = LLM(str(targets["medusa"]), max_model_len=64, num_gpu_blocks_override=8).llm_engine.core.runner.model
    a = load_spec_head("medusa", str(vllm_dir), target, torch.float32, torch.device("cpu"))
    b = load_spec_head("medusa", str(orig_dir), target, torch.float32, torch.device("cpu"))
    x = torch.randn(5, 64)
    assert torch.equal(a.draft_token_ids(x, 4), b.draft_token_ids(x, 4))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "case,field",
    [
        ("eagle_hidden", "speculative_config.model"),
        ("eagle3_target_hidden", "speculative_config.model"),
        ("medusa_hidden", "speculative_config.model"),
        ("medusa_too_many_tokens", "speculative_config.num_speculative_tokens"),
        ("eagle3_aux_layers", "speculative_config.model"),
        ("no_model", "speculative_config.model"),
    ],
)
def test_bad_heads_are_refused_at_startup(targets, tmp_path, case, field):
    method = case.split("_")[0] if case != "no_model" else "eagle"
    target = targets["eagle3" if method == "eagle3" else method if method != "no" else "eagle"]
    spec = {"method": method, "num_speculative_tokens": 2}
    if case != "no_model":
        head = build_spec_head(tmp_path / "h", method, target)
        spec["model"] = str(head)
    if case == "eagle_hidden":
        _edit_config(head, hidden_size=48)
    elif case == "eagle3_target_hidden":
        _edit_config(head, target_hidden_size=128)
    elif case == "medusa_hidden":
        _edit_config(head, hidden_size=32)
    elif case == "medusa_too_many_tokens":
        spec["num_speculative_tokens"] = 5  # the checkpoint has 4 heads
    elif case == "eagle3_aux_layers":
        _edit_config(head, eagle_aux_hidden_state_layer_ids=[1, 2, 7])
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(target), max_model_len=64, num_gpu_blocks_override=8, speculative_config=spec)
    assert e.value.param == field, str(e.value)
    assert field in str(e.value)


def test_seeded_sampling_reproduces_with_a_head(targets, heads):
    target = targets["eagle"]
    params = [
        SamplingParams(max_tokens=32, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_tokens=32, temperature=0.5, top_k=40, seed=8, n=2),
    ]
    want = _generate(LLM(str(target), max_model_len=128, num_gpu_blocks_override=32), PROMPTS[:2], params)
    llm = LLM(
        str(target), max_model_len=128, num_gpu_blocks_override=32, speculative_config=_spec("eagle", heads["eagle"])
    )
    assert _generate(llm, PROMPTS[:2], params) == want
    assert _spec_stats(llm).num_accepted_tokens > 0
