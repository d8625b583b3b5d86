"""A GGUF runs as stored by default: each tensor keeps its block type, nothing is widened to float32.

The embedded SmolLM2 file holds Q4_1 projections and a tied Q8_0 embedding; the modes are checked
against the float32 model that widens the same blocks (``quantization="none"``)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError, UnsupportedModelError
from pagedllm.layers.quantization import Int4Linear, Int8Linear, QuantizedEmbedding, common_layout
from pagedllm.model_loader import default_model_path, load_config, resolve_model
from pagedllm.model_loader.gguf_loader import read_gguf_header
from pagedllm.worker.loader import load_model

from utils import check_greedy_close

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2_models() -> dict[str, nn.Module]:
    src = resolve_model(None)
    return {
        mode: load_model(src, load_config(src), torch.float32, CPU, quantization=mode)
        for mode in (None, "gguf-exact", "none")
    }


def test_default_keeps_every_block_as_stored(smollm2_models, monkeypatch):
    """No quantization asked for (gguf-exact): Q4_1 stays 4-bit, the tied Q8_0 embedding is the 8-bit head and
    its rows are looked up there; no tensor is widened on the way."""
    from pagedllm.model_loader import gguf_loader

    widened = []
    real = gguf_loader._widen
    monkeypatch.setattr(gguf_loader, "_widen", lambda *a: widened.append(1) or real(*a))
    src = resolve_model(None)
    model = load_model(src, load_config(src), torch.float32, CPU)
    assert widened == []
    header = read_gguf_header(default_model_path())
    assert {header.tensor_types[f"blk.0.{t}.weight"] for t in ("attn_q", "ffn_up", "ffn_down")} == {3}  # Q4_1
    assert header.tensor_types["token_embd.weight"] == 8  # Q8_0
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(lin) is Int4Linear and lin.activation_bits is None  # float32 activations: exact
    assert type(model.lm_head) is Int8Linear and isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.embed_tokens.table[0] is model.lm_head  # one table, not two
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_exact_mode_is_the_float32_function_of_the_same_weights(smollm2_models):
    exact, wide = smollm2_models["gguf-exact"], smollm2_models["none"]
    assert (
        type(exact.layers[0].mlp.gate_up_proj) is Int4Linear
        and exact.layers[0].mlp.gate_up_proj.activation_bits is None
    )
    assert isinstance(wide.layers[0].mlp.gate_up_proj, nn.Linear) or hasattr(wide.layers[0].mlp.gate_up_proj, "panels")
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 7, 2, 900, 17])
    torch.testing.assert_close(exact.embed_tokens(ids), wide.embed_tokens(ids), rtol=0, atol=0)
    x = torch.randn(5, exact.config.hidden_size)
    for a, b in ((exact.layers[3].mlp.gate_up_proj, wide.layers[3].mlp.gate_up_proj), (exact.lm_head, None)):
        ref = b(x) if b is not None else x @ wide.embed_tokens.weight.T
        torch.testing.assert_close(a(x), ref, rtol=1e-4, atol=1e-4)


def test_gguf_mode_follows_the_exact_default_closely():
    """ "gguf" rounds activations to 8 bits (llama.cpp's arithmetic): not float32's function, but near it:
    where the greedy tokens part, each side's token is in the other's top 5, and logprobs stay close before."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as np\n"]
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    outs = {}
    for mode in (None, "gguf"):
        llm = LLM(max_model_len=256, max_num_seqs=4, **({"quantization": mode} if mode else {}))
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    check_greedy_close(
        outs[None], outs["gguf"], topk=5, logprob_atol=0.25, min_exact_fraction=0.25, names=("exact", "gguf")
    )


def test_shards_of_different_block_types_fuse_exactly():
    """Q4_K_M files mix Q4_K (int4, a scale per 32) and Q6_K (int8, a scale per 16) within one q/k/v: the
    fused layer holds each shard's values exactly."""
    from pagedllm import kernels
    from pagedllm.layers.quantization import quantize_int4

    k = kernels.load()
    torch.manual_seed(0)
    a = ("int4", quantize_int4(torch.randn(8, 64)))
    q = torch.randint(-32, 32, (4, 64), dtype=torch.int8)
    b = ("int8", (q, torch.rand(4, 4), torch.zeros(4, 2)))  # a scale per 16
    fused = common_layout([a, b])
    assert {kind for kind, _ in fused} == {"int8"} and {t[1].shape[1] for _, t in fused} == {4}
    want = torch.cat([k.int4_dequantize(*a[1]), k.int8_dequantize_g16(*b[1])])
    got = k.int8_dequantize_g16(*(torch.cat([t[j] for _, t in fused]) for j in range(3)))
    assert torch.equal(got, want)


def test_gguf_modes_need_a_gguf_file(tiny_model_factory):
    with pytest.raises(InvalidParameterError, match=r"quantization='gguf'.*not a GGUF"):
        LLM(str(tiny_model_factory("llama")), quantization="gguf")


def _tensor_type_offset(path: Path, name: str) -> int:
    """Where the ggml type of tensor ``name`` sits in the header (after its name, n_dims and dims)."""
    data = path.read_bytes()[: 8 << 20]
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims


def test_a_tensor_type_without_a_kernel_is_refused_by_name(tmp_path):
    path = tmp_path / "q2k.gguf"
    shutil.copy(default_model_path(), path)
    at = _tensor_type_offset(path, "blk.4.ffn_up.weight")
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<I", 10))  # Q2_K: smaller than the Q4_1 data there, so the file is not short of it
    with pytest.raises(UnsupportedModelError, match=r"Q2_K.*blk\.4\.ffn_up\.weight.*quantization='none'"):
        LLM(str(path), max_model_len=128)


def test_a_truncated_file_is_refused_before_loading(tmp_path):
    path = tmp_path / "cut.gguf"
    data = Path(default_model_path()).read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(UnsupportedModelError, match=r"cut\.gguf.*truncated"):
        LLM(str(path), max_model_len=128)


def test_a_file_cut_inside_its_vocabulary_is_refused_by_name(tmp_path):
    path = tmp_path / "vocab_cut.gguf"
    data = Path(default_model_path()).read_bytes()
    path.write_bytes(data[: data.index(b"tokenizer.ggml.merges") + 4096])  # mid-way through the merges' strings
    with pytest.raises(UnsupportedModelError, match=r"vocab_cut\.gguf"):
        LLM(str(path), max_model_len=128)


def test_kv_cache_is_sized_for_what_it_holds(monkeypatch):
    llm = LLM(max_model_len=256, max_num_seqs=4)
    assert llm.llm_engine.num_blocks == 4 * (256 // 16 + 1)
    del llm
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.25")
    llm = LLM(max_model_len=256, max_num_seqs=4)
    from pagedllm.worker.kv_cache import bytes_per_block

    cfg = llm.llm_engine.hf_config
    per_block = bytes_per_block(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, 64, torch.float32)
    assert llm.llm_engine.num_blocks == 2**28 // per_block
    del llm
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    with pytest.raises(InvalidParameterError, match=r"kv_cache_memory asks for .* GiB"):
        LLM(max_model_len=256, kv_cache_memory=1 << 50)
