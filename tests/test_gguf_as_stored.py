"""A GGUF runs as stored by default: each tensor keeps its block type, nothing is widened to float32.

The embedded SmolLM2 file holds Q4_1 projections and a tied Q8_0 embedding; the modes are checked
against the float32 model that widens the same blocks (``quantization="none"``)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError, UnsupportedModelError
from pagedllm.kernels import isa
from pagedllm.layers.quantization import Int4Linear, Int8Linear, QuantizedEmbedding, common_layout
from pagedllm.model_loader import default_model_path, load_config, resolve_model
from pagedllm.model_loader.gguf_loader import read_gguf_header
from pagedllm.worker.loader import load_model

from utils import check_greedy_close, kernels_at

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2_models() -> dict[str, nn.Module]:
    src = resolve_model(None)
    return {
        mode: load_model(src, load_config(src), torch.float32, CPU, quantization=mode)
        for mode in ("gguf-exact", "none")
    }


@pytest.mark.parametrize("mode", [None, "gguf-exact"])
def test_default_keeps_every_block_as_stored(mode, monkeypatch):
    """Both GGUF modes keep every block as stored, no tensor widened on the way. The default (where the CPU has the
    panels, AVX2 and up: 'gguf') runs SmolLM2's Q4_1 projections in panels of 16 rows and its tied Q8_0 embedding
    as the Q8_0 head in panels too, its rows looked up there; 'gguf-exact' (the default below AVX2) holds Q4_1 as
    4-bit groups, the embedding as the 8-bit head, with float32 activations."""
    from pagedllm import kernels
    from pagedllm.layers.gguf_linear import GGUFLinear
    from pagedllm.model_loader import gguf_loader

    widened = []
    real = gguf_loader._widen
    monkeypatch.setattr(gguf_loader, "_widen", lambda *a: widened.append(1) or real(*a))
    src = resolve_model(None)
    model = load_model(src, load_config(src), torch.float32, CPU, **({"quantization": mode} if mode else {}))
    assert widened == []
    header = read_gguf_header(default_model_path())
    assert {header.tensor_types[f"blk.0.{t}.weight"] for t in ("attn_q", "ffn_up", "ffn_down")} == {3}  # Q4_1
    assert header.tensor_types["token_embd.weight"] == 8  # Q8_0
    panels = mode is None and kernels.load().gguf.has_panels
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if panels:  # Q4_1 in panels (a fused projection: each shard's), int8 activations
                assert all(p.qtype == 103 for p in getattr(lin, "parts", [lin])), lin
            else:
                assert type(lin) is Int4Linear and lin.activation_bits is None  # float32 activations: exact
    if panels:
        assert type(model.lm_head) is GGUFLinear and model.lm_head.qtype == 108  # Q8_0 in panels
    else:
        assert type(model.lm_head) is Int8Linear
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
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


def test_gguf_mode_follows_the_exact_mode_closely():
    """ "gguf" rounds activations to 8 bits (llama.cpp's arithmetic): not float32's function, but near it:
    where the greedy tokens part, each side's token is in the other's top 5, and logprobs stay close before."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as np\n"]
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    outs = {}
    for mode in ("gguf-exact", "gguf"):
        llm = LLM(max_model_len=256, max_num_seqs=4, quantization=mode)
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    check_greedy_close(
        outs["gguf-exact"], outs["gguf"], topk=5, logprob_atol=0.25, min_exact_fraction=0.25, names=("exact", "gguf")
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
    path = tmp_path / "iq3.gguf"
    shutil.copy(default_model_path(), path)
    at = _tensor_type_offset(path, "blk.4.ffn_up.weight")
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<I", 18))  # IQ3_XXS: smaller than the Q4_1 data there, so the file is not short of it
    with pytest.raises(UnsupportedModelError, match=r"IQ3_XXS.*blk\.4\.ffn_up\.weight.*quantization='none'"):
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


def _write_gguf(path: Path, tensors: dict[str, tuple]) -> Path:
    """A GGUF holding only ``tensors`` (name: (ggml type name, rows[, columns: 256])), zero bytes."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    for name, (kind, rows, *cols) in tensors.items():
        qtype, k = gguf.GGMLQuantizationType[kind], cols[0] if cols else 256
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if kind == "F32":
            writer.add_tensor(name, np.zeros((rows, k), dtype=np.float32))
        else:
            writer.add_tensor(name, np.zeros((rows, k // block * size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_default_for_a_gguf_is_int8_activations_only_where_every_tensor_runs_in_panels(tmp_path, monkeypatch):
    """A file whose quantized tensors are all of types with panels (Q4_K / Q6_K / Q8_0 / Q5_0 in a Q4_K_M file; Q4_1
    and Q5_1 since 2026-11-29, so the embedded SmolLM2 too) in whole panels of 16 rows runs 'gguf' by default where
    the CPU has the panel kernels, in one process: one kernel at every batch size. Anything else (rows not in whole
    panels, rows of an odd number of 32-blocks, another CPU, several ranks) keeps 'gguf-exact'; what was asked is
    kept."""
    from pagedllm import kernels
    from pagedllm.model_loader.gguf_loader import all_in_panels, iter_gguf_blocks
    from pagedllm.worker.loader import resolve_quantization

    k4m = {"blk.0.attn_q.weight": ("Q4_K", 32), "token_embd.weight": ("Q6_K", 64), "blk.0.attn_norm.weight": ("F32", 1)}
    files = {
        "q4_k_m": _write_gguf(tmp_path / "a.gguf", k4m),
        "with_q8_0": _write_gguf(tmp_path / "b.gguf", {**k4m, "blk.0.ffn_down.weight": ("Q8_0", 32)}),
        "with_q4_1": _write_gguf(tmp_path / "d.gguf", {**k4m, "blk.0.ffn_down.weight": ("Q4_1", 32)}),
        "with_q5_1": _write_gguf(tmp_path / "n.gguf", {**k4m, "blk.0.ffn_down.weight": ("Q5_1", 32)}),
        "ragged_q4_1": _write_gguf(tmp_path / "o.gguf", {**k4m, "blk.0.ffn_down.weight": ("Q4_1", 40)}),
        "odd_q5_1": _write_gguf(tmp_path / "p.gguf", {**k4m, "blk.0.ffn_down.weight": ("Q5_1", 32, 96)}),
        "ragged": _write_gguf(tmp_path / "c.gguf", {**k4m, "blk.0.attn_k.weight": ("Q4_K", 40)}),
        "odd_blocks": _write_gguf(tmp_path / "e.gguf", {**k4m, "blk.0.ffn_down.weight": ("Q5_0", 32, 96)}),
        "q5_k_m": _write_gguf(tmp_path / "g.gguf", {**k4m, "blk.0.attn_q.weight": ("Q5_K", 32)}),
        "q4_0": _write_gguf(tmp_path / "i.gguf", {**k4m, "blk.0.attn_q.weight": ("Q4_0", 32)}),
        "iq4_nl": _write_gguf(tmp_path / "j.gguf", {**k4m, "blk.0.attn_q.weight": ("IQ4_NL", 32)}),
        "iq4_xs": _write_gguf(tmp_path / "k.gguf", {**k4m, "blk.0.attn_q.weight": ("IQ4_XS", 32)}),
        "q3_k_m": _write_gguf(tmp_path / "l.gguf", {**k4m, "blk.0.attn_q.weight": ("Q3_K", 32)}),
        "q2_k": _write_gguf(tmp_path / "m.gguf", {**k4m, "blk.0.attn_q.weight": ("Q2_K", 32)}),
        "ragged_q5_k": _write_gguf(tmp_path / "h.gguf", {**k4m, "blk.0.attn_q.weight": ("Q5_K", 40)}),
    }
    panels = kernels.load().gguf.has_panels
    assert all_in_panels(str(files["q4_k_m"])) == all_in_panels(str(files["with_q8_0"])) == panels
    assert all_in_panels(str(files["q5_k_m"])) == all_in_panels(str(files["q4_0"])) == panels
    assert all_in_panels(str(files["iq4_nl"])) == all_in_panels(str(files["iq4_xs"])) == panels
    assert all_in_panels(str(files["q3_k_m"])) == all_in_panels(str(files["q2_k"])) == panels
    assert all_in_panels(str(files["with_q4_1"])) == all_in_panels(str(files["with_q5_1"])) == panels
    not_in_panels = ("ragged", "odd_blocks", "ragged_q5_k", "ragged_q4_1", "odd_q5_1")
    assert not any(all_in_panels(str(files[name])) for name in not_in_panels)
    # under an explicit 'gguf', Q8_0 / Q5_0 come as stored only where they fit panels (else as int8 groups)
    names = ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.0.attn_k.weight")
    # in panels; rows not in whole panels; 3 blocks a row; Q5_K rows not in whole panels
    shapes = [("Q8_0", 32), ("Q8_0", 40), ("Q5_0", 32, 96), ("Q5_K", 40)]
    odd = _write_gguf(tmp_path / "f.gguf", dict(zip(names, shapes, strict=True)))
    kinds = [kind for _, (kind, _) in iter_gguf_blocks(str(odd), native=("Q8_0", "Q5_0", "Q5_K"))]
    assert kinds == ["Q8_0", "int8", "int8", "int8"]

    def default(name: str, single: bool = True) -> str | None:
        return resolve_quantization(None, resolve_model(str(files[name])), None, CPU, single)

    assert (
        default("q4_k_m")
        == default("with_q8_0")
        == default("q5_k_m")
        == default("q4_0")
        == default("iq4_nl")
        == default("iq4_xs")
        == default("q3_k_m")
        == default("q2_k")
        == default("with_q4_1")
        == default("with_q5_1")
    )
    assert default("q4_k_m") == ("gguf" if panels else "gguf-exact")
    assert default("q4_k_m", single=False) == default("ragged_q4_1") == default("ragged") == "gguf-exact"
    assert default("odd_q5_1") == "gguf-exact"
    assert resolve_quantization("gguf-exact", resolve_model(str(files["q4_k_m"])), None, CPU) == "gguf-exact"
    smollm2 = resolve_quantization(None, resolve_model(None), None, CPU)  # its Q4_1 and Q8_0 tensors
    assert smollm2 == ("gguf" if panels else "gguf-exact")
    monkeypatch.setattr(kernels.load().gguf, "has_panels", False)  # a CPU below AVX2
    assert default("q4_k_m") == "gguf-exact"


def _random_k_quant(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """rows x cols weights in valid random blocks of ``kind`` (Q4_K / Q5_K / Q6_K / Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q5_1
    / Q3_K / IQ4_NL / IQ4_XS / Q2_K) with small float16 scales, [rows, bytes] (every bit pattern is a valid block;
    Q4_1 / Q5_1: a min of about minus half the range, so that the weights' mean is near 0)."""
    import gguf

    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
    for off in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}.get(kind, (0,)):
        scale = rng.uniform(2e-5, 2e-4, (rows, cols // elems, 1)).astype(np.float16)
        if elems == 32:  # weights of the K-quants' size (theirs: d times a 6-bit sub-block scale times q)
            scale *= {"Q5_0": 32, "Q5_1": 32, "Q4_0": 64, "Q4_1": 64, "IQ4_NL": 1}.get(kind, 4)
        if kind == "IQ4_XS":  # d times a 6-bit scale (minus 32) times a value of up to 127
            scale /= 8
        raw[..., off : off + 2] = scale.view(np.uint8)
        if kind in ("Q4_1", "Q5_1"):  # m after d
            half_range = {"Q4_1": 8, "Q5_1": 16}[kind] * rng.uniform(0.7, 1.3, scale.shape)
            raw[..., 2:4] = (-scale.astype(np.float32) * half_range).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _write_tiny_q4_k_m(path: Path, vocab: int) -> Path:
    """A 2-layer Qwen2 GGUF whose every quantized tensor is Q4_K or Q6_K (v, ffn_down and the tied embedding
    Q6_K) in layer 0, Q5_0 and Q8_0 (v) in layer 1 beside a Q5_K ffn_up (a Q5_K_M file's type), a Q4_0
    attn_output, an IQ4_NL attn_k, an IQ4_XS ffn_gate and a Q6_K ffn_down, as Q4_K_M files have them (Qwen2.5's
    0.5B falls back to those where its rows of 896 are no whole super-blocks), and in layer 0 a Q3_K attn_output, a
    Q2_K ffn_up, a Q4_1 attn_k and a Q5_1 ffn_gate; random blocks; no tokenizer (the engine is given SmolLM2's)."""

    def kind(layer: int, name: str) -> str:
        q4, q6 = ("Q4_K", "Q6_K") if layer == 0 else ("Q5_0", "Q8_0")
        if layer == 0 and name in ("attn_output", "ffn_up", "attn_k", "ffn_gate"):
            return {"attn_output": "Q3_K", "ffn_up": "Q2_K", "attn_k": "Q4_1", "ffn_gate": "Q5_1"}[name]
        if name == "ffn_down":
            return "Q6_K"
        if layer == 1 and name in ("attn_output", "ffn_up", "attn_k", "ffn_gate"):
            return {"attn_output": "Q4_0", "ffn_up": "Q5_K", "attn_k": "IQ4_NL", "ffn_gate": "IQ4_XS"}[name]
        return q6 if name == "attn_v" else q4

    return _write_tiny_qwen2(path, vocab, "Q6_K", kind)


def _write_tiny_qwen2(path: Path, vocab: int, embedding: str, kind, head: str | None = None) -> Path:
    """A 2-layer Qwen2 GGUF of random blocks: the embedding of type ``embedding``, tied to the LM head unless
    ``head`` names the type of an ``output.weight`` of its own, each projection of type ``kind(layer, name)``
    (name: attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down); float32 norms and biases; no
    tokenizer (the engine is given SmolLM2's)."""
    import gguf

    rng = np.random.default_rng(11)
    hidden, ffn, heads, kv_heads, head_dim, layers = 256, 512, 4, 2, 64, 2
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)

    def quant(name: str, kind: str, rows: int, cols: int) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("F16", "BF16"):  # float weights: float16 as it is, bfloat16 as its top 16 bits
            w = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
            half = w.astype(np.float16) if kind == "F16" else (w.view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, half.view(np.uint8), raw_dtype=qtype)
            return
        writer.add_tensor(name, _random_k_quant(kind, rows, cols, rng), raw_dtype=qtype)

    def plain(name: str, n: int, value: float | None = None) -> None:
        data = np.full(n, value, np.float32) if value is not None else rng.normal(0, 0.02, n).astype(np.float32)
        writer.add_tensor(name, data)

    quant("token_embd.weight", embedding, vocab, hidden)
    if head is not None:
        quant("output.weight", head, vocab, hidden)
    plain("output_norm.weight", hidden, 1.0)
    for i in range(layers):
        b = f"blk.{i}"
        plain(f"{b}.attn_norm.weight", hidden, 1.0)
        plain(f"{b}.ffn_norm.weight", hidden, 1.0)
        quant(f"{b}.attn_q.weight", kind(i, "attn_q"), heads * head_dim, hidden)
        quant(f"{b}.attn_k.weight", kind(i, "attn_k"), kv_heads * head_dim, hidden)
        quant(f"{b}.attn_v.weight", kind(i, "attn_v"), kv_heads * head_dim, hidden)
        for name, n in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
            plain(f"{b}.{name}.bias", n)
        quant(f"{b}.attn_output.weight", kind(i, "attn_output"), hidden, heads * head_dim)
        quant(f"{b}.ffn_gate.weight", kind(i, "ffn_gate"), ffn, hidden)
        quant(f"{b}.ffn_up.weight", kind(i, "ffn_up"), ffn, hidden)
        quant(f"{b}.ffn_down.weight", kind(i, "ffn_down"), hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("table", ["Q4_K", "Q5_K"])
def test_an_embedding_beside_its_own_head_stays_in_the_files_mapping(tmp_path, smollm2_tokenizer_dir, table):
    """A file whose LM head is a tensor of its own (``output.weight``, as most Q4_K_M / Q6_K / Q8_0 files of
    Qwen2.5 have it) looks its embedding rows up in the file's own mapping: the table is not repacked into
    panels (a copy in the process's memory, 0.12 GiB of Qwen2.5-1.5B Q4_K_M's RSS), and only the pages of the
    rows read become resident. Its rows are the file's values bit for bit, for a type read only in panels
    (Q5_K) too, and the engine's tokens are those of the table repacked as before, and under 'gguf-exact' those of
    the model with the table widened to float32."""
    from pagedllm import kernels
    from pagedllm.layers import gguf_linear
    from pagedllm.layers.gguf_linear import GGUF_TYPES, GGUFLinear

    if table == "Q5_K" and not kernels.load().gguf.has_panels:
        pytest.skip("the 'gguf' mode reads Q5_K in panels only (AVX2 and up)")

    path = _write_tiny_qwen2(tmp_path / "tiny-head.gguf", 49152, table, lambda layer, name: "Q4_K", head="Q6_K")
    src = resolve_model(str(path))
    ours, wide = (load_model(src, load_config(src), torch.float32, CPU, quantization=m) for m in ("gguf", "none"))
    emb = ours.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.table[0] is not ours.lm_head  # a table of its own
    t = emb.table[0]
    assert type(t) is GGUFLinear and t.lookup_only and t.qtype == t.file_qtype == GGUF_TYPES[table]  # not repacked
    lo, hi = t.raw.data_ptr(), t.raw.data_ptr() + t.raw.numel()
    spans = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith(str(path))]
    assert any(int(a, 16) <= lo and hi <= int(b, 16) for a, b in spans)  # the file's mapping, no copy
    ids = torch.tensor([0, 1, 504, 3458, 49151, 282, 504])
    assert torch.equal(emb(ids), wide.embed_tokens(ids))  # the file's values, bit for bit
    assert torch.equal(emb(ids.view(1, -1))[0], emb(ids))
    with pytest.raises(RuntimeError, match="only looked up"):
        t(torch.randn(2, t.in_features))
    del ours, wide

    prompts = [[(37 * j + 11 * i) % 40000 + 100 for j in range(6 + 5 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)

    def run(mode: str, lookup_only: bool = True) -> list:
        llm = LLM(str(path), tokenizer=str(smollm2_tokenizer_dir), max_model_len=128, quantization=mode)
        table = getattr(llm.llm_engine.core.runner.model.embed_tokens, "table", [None])[0]  # 'none': a float one
        assert getattr(table, "lookup_only", False) == (lookup_only and mode == "gguf")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    got = run("gguf")
    stacked = gguf_linear.stacked_gguf
    with pytest.MonkeyPatch.context() as mp:  # the table repacked into panels, as before
        mp.setattr(gguf_linear, "stacked_gguf", lambda *a, **kw: stacked(*a[:4]))
        assert run("gguf", lookup_only=False) == got
    exact, wide = run("gguf-exact"), run("none")
    check_greedy_close(
        [SimpleNamespace(token_ids=t, logprobs=lp) for t, lp in exact],
        [SimpleNamespace(token_ids=t, logprobs=lp) for t, lp in wide],
        topk=5,
        logprob_atol=1e-3,
        min_exact_fraction=1.0,
    )


def test_the_mlp_takes_a_long_chunk_in_runs_of_rows_and_its_tokens_are_unchanged(
    tmp_path, smollm2_tokenizer_dir, monkeypatch
):
    """A prefill chunk's MLP runs ``MLP_ROWS`` rows at a time, so its intermediate activations (gate|up and the
    activation: 210 MiB for 2,048 rows of Qwen2.5-1.5B) are those of 256 rows at most. In the 'gguf' mode each row's
    output is computed alone, so a 600-token prompt's logprobs are the same bits whole as in runs of 256 or 100. There,
    gate|up and the activation are written into one buffer per thread (mlp._scratch, reused by every layer and
    step): the same bits as in tensors of their own."""
    from pagedllm import kernels
    from pagedllm.layers import mlp
    from pagedllm.layers.gguf_linear import GGUFLinear, StackedLinear

    if not kernels.load().gguf.has_panels:
        pytest.skip("one kernel at every row count needs the panels (AVX2 and up)")
    path = _write_tiny_qwen2(tmp_path / "tiny-mlp.gguf", 49152, "Q6_K", lambda layer, name: "Q4_K")
    prompts = [[(37 * j + 11 * i) % 40000 + 100 for j in range(n)] for i, n in enumerate((600, 300, 40))]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    rows: list[int] = []
    local = mlp.GatedMLP._local
    monkeypatch.setattr(mlp.GatedMLP, "_local", lambda self, x: rows.append(x.shape[0]) or local(self, x))
    tok = str(smollm2_tokenizer_dir)
    llm = LLM(str(path), tokenizer=tok, max_model_len=1024, quantization="gguf", enable_prefix_caching=False)
    buffers: list[int] = []  # the address of the buffer each call of the MLP was given

    def scratch(rows, intermediate, scratch=mlp._scratch):
        gate_up, act = scratch(rows, intermediate)
        buffers.append(gate_up.untyped_storage().data_ptr())
        return gate_up, act

    monkeypatch.setattr(mlp, "_scratch", scratch)
    got = {}
    for run in (10**9, 256, 100):
        monkeypatch.setattr(mlp, "MLP_ROWS", run)
        rows.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        got[run] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert max(rows) == min(run, 940)  # the three prompts' 940 tokens in one step, or in runs
    assert got[256] == got[10**9] and got[100] == got[10**9]
    # one buffer (grown to the 940 rows of the first step), reused by every layer and step of the three runs
    assert len(buffers) >= 3 * 4 and len(set(buffers[len(buffers) // 3 :])) == 1, set(buffers)
    for cls in (GGUFLinear, StackedLinear):  # gate|up and the activation in tensors of their own
        monkeypatch.setattr(cls, "forward_into", None)
    buffers.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert not buffers and [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] == got[10**9]


@pytest.fixture(params=[level for level in isa.machine_levels() if level != "portable"])
def kernel_level(request):
    """Every kernel level this machine runs that has the GGUF panels (AVX2 and up): the machine's own build, or one
    built for the level named (``$PAGEDLLM_CPU_LEVEL``), loaded in its place for the test and then put back."""
    with kernels_at(request.param):
        yield request.param


@pytest.mark.slow
def test_a_q4_k_m_file_runs_int8_activations_by_default_and_its_tokens_ignore_the_schedule(
    tmp_path, smollm2_tokenizer_dir, kernel_level
):
    """Where the panel kernels run (AVX2 and AVX-512 VNNI), a file of Q4_K / Q6_K / Q5_0 / Q8_0 tensors (and every other
    type with panels) runs 'gguf' by default, and a request's logprobs are the same bits however it is scheduled: alone
    or beside 11 others, its prompt's shared start in the prefix cache or not, prefilled whole or in chunks of 24, its
    tokens drafted by n-gram lookup and verified, or computed again after a preemption. At every level the machine runs
    (the linears' bits are the same at each, test_gguf_kernels; attention and the norms sum in another order on AVX-512
    than on AVX2)."""
    from pagedllm import kernels
    from pagedllm.layers.gguf_linear import GGUFLinear

    assert kernels.load().gguf.has_panels
    path = _write_tiny_q4_k_m(tmp_path / "tiny-q4_k_m.gguf", 49152)
    shared = [(37 * j) % 40000 + 100 for j in range(40)]
    prompts = [shared + [(11 * i + 3 * j) % 40000 + 100 for j in range(3 + 4 * i)] for i in range(12)]
    prompts[5], prompts[7] = shared[:25], prompts[7][:49]  # chunks of 24 and 1, of 24, 24 and 1
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

    def run(**kw) -> list:
        llm = LLM(str(path), tokenizer=str(smollm2_tokenizer_dir), max_model_len=256, **kw)
        model = llm.llm_engine.core.runner.model
        assert isinstance(model.layers[0].mlp.down_proj, GGUFLinear) and model.layers[0].mlp.down_proj.qtype == 114
        assert [p.qtype for p in model.layers[1].self_attn.qkv_proj.parts] == [106, 120, 108]  # Q5_0, IQ4_NL, Q8_0
        assert [p.qtype for p in model.layers[1].mlp.gate_up_proj.parts] == [123, 113]  # IQ4_XS, Q5_K in panels
        assert model.layers[1].self_attn.o_proj.qtype == 102  # Q4_0 in panels
        assert model.layers[0].self_attn.o_proj.qtype == 111  # Q3_K in panels
        assert [p.qtype for p in model.layers[0].self_attn.qkv_proj.parts] == [112, 103, 114]  # Q4_K, Q4_1, Q6_K
        assert [p.qtype for p in model.layers[0].mlp.gate_up_proj.parts] == [107, 110]  # Q5_1, Q2_K in panels
        if kw.get("enable_prefix_caching"):
            llm.generate([{"prompt_token_ids": shared + [7]}], sp, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if "num_gpu_blocks_override" in kw:
            assert llm.llm_engine.core.scheduler.num_preemptions > 0
        if "speculative_config" in kw:
            assert sum(o.metrics.spec_num_draft_tokens or 0 for o in outs) > 0
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    alone = run(max_num_seqs=1, enable_prefix_caching=False)
    assert len({tuple(ids) for ids, _ in alone}) > 1  # the random model does not answer every prompt alike
    assert run(max_num_seqs=16, enable_prefix_caching=False) == alone
    assert run(max_num_seqs=16, enable_prefix_caching=True) == alone
    chunked = dict(enable_prefix_caching=False, max_num_batched_tokens=24, enable_chunked_prefill=True)
    assert run(max_num_seqs=1, **chunked) == alone  # each prompt alone, so its chunks are cut as above
    assert run(max_num_seqs=16, **chunked) == alone
    # drafts verified as a chunk of queries after the cache, and decoded tokens computed again after preemption
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "backoff_after_rejections": 0}
    assert run(max_num_seqs=16, enable_prefix_caching=False, speculative_config=ngram) == alone
    assert run(max_num_seqs=16, enable_prefix_caching=False, num_gpu_blocks_override=16) == alone


def test_q2_k_q3_k_and_the_4_bit_i_quants_load_as_stored_as_float32s_function_of_their_blocks(
    tmp_path, smollm2_tokenizer_dir
):
    """Q2_K, Q3_K (Q3_K_M files), IQ4_NL and IQ4_XS run as stored under the GGUF modes, and Q5_1 and Q4_1 beside them
    (one fused q | k | v: Q5_1, Q4_1, IQ4_NL). Under 'gguf-exact' each tensor is in our int8 groups holding exactly
    the values gguf dequantizes it to (Q2_K and Q3_K with a scale per 16, Q2_K with a min per 16; Q5_1 and Q4_1 with
    a min per 32), with float32 activations, so a model is the float32 function of the file's weights: its greedy
    tokens are those of the model that widens every weight ('none'). 'gguf' (their default where the CPU has the
    panels) runs them in panels, near that function. Other i-quants are refused (test above)."""
    from pagedllm.model_loader.gguf_loader import all_in_panels, iter_gguf_weights
    from pagedllm.worker.loader import resolve_quantization

    kinds = {"attn_q": "Q5_1", "attn_k": "Q4_1", "attn_v": "IQ4_NL", "attn_output": "Q3_K"}
    kinds |= {"ffn_gate": "IQ4_XS", "ffn_up": "Q2_K", "ffn_down": "IQ4_NL"}
    path = _write_tiny_qwen2(tmp_path / "tiny-iq.gguf", 49152, "IQ4_XS", lambda layer, name: kinds[name])
    from pagedllm import kernels

    panels = kernels.load().gguf.has_panels
    assert all_in_panels(str(path)) == panels
    assert resolve_quantization(None, resolve_model(str(path)), None, CPU) == ("gguf" if panels else "gguf-exact")
    src = resolve_model(str(path))
    exact, wide = (
        load_model(src, load_config(src), torch.float32, CPU, quantization=mode) for mode in ("gguf-exact", "none")
    )
    layer, ref = exact.layers[0], wide.layers[0]
    assert type(layer.mlp.down_proj) is Int8Linear and layer.mlp.down_proj.scales_per_group == 1  # IQ4_NL
    assert type(layer.self_attn.o_proj) is Int8Linear and layer.self_attn.o_proj.scales_per_group == 2  # Q3_K
    assert isinstance(exact.embed_tokens, QuantizedEmbedding)  # the IQ4_XS table, shared with the head
    assert not any(isinstance(m, nn.Linear) for m in exact.modules())
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 7, 2, 900, 17])
    assert torch.equal(exact.embed_tokens(ids), wide.embed_tokens(ids))  # the same values, bit for bit
    # gguf's own dequantization (iter_gguf_weights widens these types through it), bit for bit
    weights = dict(iter_gguf_weights(str(path)))
    mlp = "model.layers.0.mlp"
    assert torch.equal(layer.mlp.down_proj.dequantized()[0], weights[f"{mlp}.down_proj.weight"])
    gate_up = torch.cat([weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]])
    assert torch.equal(layer.mlp.gate_up_proj.dequantized()[0], gate_up)  # IQ4_XS beside Q2_K, fused
    attn = "model.layers.0.self_attn"
    qkv = torch.cat([weights[f"{attn}.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.dequantized()[0], qkv)  # Q5_1, Q4_1 and IQ4_NL, fused
    assert layer.mlp.gate_up_proj.mins.shape[1] == exact.config.hidden_size // 16  # Q2_K's mins per 16
    x = torch.randn(3, exact.config.hidden_size)
    torch.testing.assert_close(layer.self_attn.o_proj(x), ref.self_attn.o_proj(x), rtol=1e-5, atol=1e-6)
    del exact, wide

    prompts = [[(37 * j + 11 * i) % 40000 + 100 for j in range(6 + 5 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = {}
    for mode in ("gguf-exact", "none", "gguf"):
        llm = LLM(str(path), tokenizer=str(smollm2_tokenizer_dir), max_model_len=128, quantization=mode)
        outs[mode] = [
            o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        ]
        del llm
    assert len({tuple(o.token_ids) for o in outs["none"]}) > 1  # the random model does not answer every prompt alike
    check_greedy_close(outs["gguf-exact"], outs["none"], topk=5, logprob_atol=1e-3, min_exact_fraction=1.0)
    check_greedy_close(outs["gguf"], outs["gguf-exact"], topk=5, logprob_atol=0.25, min_exact_fraction=0.25)


def test_f16_and_bf16_matrices_run_as_stored_as_float32s_function_of_the_files_weights(
    tmp_path, smollm2_tokenizer_dir, monkeypatch
):
    """An F16 / BF16 GGUF's matrices stay 2 bytes a weight under both GGUF modes (HalfLinear, never a float32
    copy): float32 products of the weights widened exactly. 'gguf-exact', the default for a file of float tensors
    only, gives transformers' greedy tokens on the same file; 'gguf' runs one kernel at every row count, so a
    request's logprobs are the same bits alone as beside others."""
    from transformers import AutoModelForCausalLM

    from pagedllm import kernels
    from pagedllm.layers.gguf_linear import HalfLinear
    from pagedllm.model_loader.gguf_loader import all_in_panels
    from pagedllm.worker.loader import resolve_quantization

    from utils import hf_greedy

    path = _write_tiny_qwen2(tmp_path / "tiny-f16.gguf", 49152, "F16", lambda layer, name: ("F16", "BF16")[layer])
    src = resolve_model(str(path))
    # no integer arithmetic to run: float32 activations; but bfloat16 dot products where the CPU has them
    bf16_dot = kernels.load().gguf.has_bf16_dot
    assert all_in_panels(str(path)) == bf16_dot
    assert resolve_quantization(None, src, None, CPU) == ("gguf" if bf16_dot else "gguf-exact")
    exact, wide = (
        load_model(src, load_config(src), torch.float32, CPU, quantization=mode) for mode in ("gguf-exact", "none")
    )
    qkv, gate_up = exact.layers[0].self_attn.qkv_proj, exact.layers[1].mlp.gate_up_proj
    assert type(qkv) is HalfLinear and qkv.weight.dtype == torch.float16
    assert type(gate_up) is HalfLinear and gate_up.weight.dtype == torch.bfloat16
    assert isinstance(exact.embed_tokens, QuantizedEmbedding) and type(exact.lm_head) is HalfLinear  # one table
    assert not any(isinstance(m, nn.Linear) for m in exact.modules())
    halves = [m for m in exact.modules() if isinstance(m, HalfLinear)]
    assert all(m.weight.element_size() == 2 for m in halves) and len(halves) == 1 + 2 * 4
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 7, 2, 900, 17])
    assert torch.equal(exact.embed_tokens(ids), wide.embed_tokens(ids))  # the file's values, bit for bit
    for m in (3, 20):  # the kernel, and the float32 GEMM on the widened weights
        x = torch.randn(m, exact.config.hidden_size)
        for ours, ref in ((qkv, wide.layers[0].self_attn.qkv_proj), (gate_up, wide.layers[1].mlp.gate_up_proj)):
            torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
    head = torch.randn(9, exact.config.hidden_size)
    torch.testing.assert_close(exact.lm_head(head), wide.lm_head(head), rtol=1e-5, atol=1e-6)
    from pagedllm.layers import gguf_linear

    monkeypatch.setattr(gguf_linear, "_WIDEN_ELEMS", 1000 * exact.config.hidden_size)  # widened 1,000 rows at a time
    torch.testing.assert_close(exact.lm_head(head), wide.lm_head(head), rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    del exact, wide

    prompts = [[(37 * j + 11 * i) % 40000 + 100 for j in range(6 + 5 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    want = hf_greedy(hf, prompts, 8)
    assert len({tuple(r.token_ids) for r in want}) > 1  # the random model does not answer every prompt alike
    del hf

    def run(mode: str, **kw) -> list:
        llm = LLM(str(path), tokenizer=str(smollm2_tokenizer_dir), max_model_len=128, quantization=mode, **kw)
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]

    exact = run("gguf-exact")
    check_greedy_close(exact, want, topk=5, logprob_atol=1e-3, min_exact_fraction=1.0)
    alone = run("gguf", max_num_seqs=1)
    assert [(o.token_ids, o.logprobs) for o in run("gguf", max_num_seqs=8)] == [
        (o.token_ids, o.logprobs) for o in alone
    ]
    # 'gguf': layer 1's BF16 matrices in bfloat16 dot products where the CPU has them (x rounded), near float32's
    check_greedy_close(alone, exact, topk=5, logprob_atol=0.25 if bf16_dot else 1e-3, min_exact_fraction=0.25)
    if bf16_dot:
        model = LLM(str(path), tokenizer=str(smollm2_tokenizer_dir), max_model_len=128, quantization="gguf")
        layers = model.llm_engine.core.runner.model.layers
        assert layers[1].mlp.gate_up_proj.bf16_dot and not layers[0].mlp.gate_up_proj.bf16_dot  # BF16, F16
