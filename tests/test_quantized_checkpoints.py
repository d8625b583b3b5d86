"""AWQ (AutoAWQ's GEMM layout) and GPTQ checkpoints, written here by the formats' rules since none can be
downloaded: they load into the int4 / int8 kernels without a second rounding and compute what their
dequantized weights do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.errors import UnsupportedModelError
from pagedllm.model_loader import awq
from pagedllm.model_loader.quant_config import checkpoint_scheme

from utils import check_greedy_close, hf_greedy

GROUP = 128
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _round(w: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric rounding of W [out, in] in groups along in: (q [in, out], zero points, fp16 scales [G, out])."""
    out, k = w.shape
    top = (1 << bits) - 1
    g = w.t().reshape(k // group, group, out)  # [groups, group, out]
    lo, hi = g.amin(dim=1), g.amax(dim=1)
    scales = ((hi - lo).clamp(min=1e-5) / top).half()
    s = scales.float()
    zeros = torch.clamp(torch.round(-lo / s), 0, top)
    q = torch.clamp(torch.round(g / s[:, None]) + zeros[:, None], 0, top).reshape(k, out)
    return q, zeros, scales


def _dequantized(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights the rounding stands for, computed here from the unpacked values: W [out, in]."""
    group = q.shape[0] // zeros.shape[0]
    return ((q - zeros.repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)).t().contiguous()


def _awq(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, zeros, scales = _round(w, GROUP, 4)
    return {"qweight": awq.pack(q), "qzeros": awq.pack(zeros), "scales": scales}, _dequantized(q, zeros, scales)


def _pack_gptq(v: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """GPTQ's packing: ``32 / bits`` values a word along ``dim``, lowest bits first."""
    per = 32 // bits
    v = v.to(torch.int64)
    v = v.reshape(v.shape[0] // per, per, v.shape[1]).transpose(1, 2) if dim == 0 else v.reshape(v.shape[0], -1, per)
    word = sum(v[..., i] << (bits * i) for i in range(per))
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()


def _gptq(bits: int, group: int, v1: bool, act_order: bool = False):
    def write(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        k = w.shape[1]
        g = k if group == -1 else group
        # act-order: the inputs are quantized in an order of their own (GPTQ: by the Hessian's diagonal), one
        # order per input size here, as the linears sharing an input (q|k|v, gate|up) have it
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act_order else torch.arange(k)
        q_sorted, zeros, scales = _round(w[:, order], g, bits)  # groups are runs of that order
        if v1:  # the original format keeps each zero point minus one: 0 must not occur
            zeros = zeros.clamp(min=1)
        q = torch.empty_like(q_sorted)
        q[order] = q_sorted  # q is [in, out]: back to the inputs' own order
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // g).to(torch.int32)
        stored = zeros - 1 if v1 else zeros
        deq = torch.empty(w.shape)
        deq[:, order] = _dequantized(q_sorted, zeros, scales)
        return (
            {
                "qweight": _pack_gptq(q, bits, 0),
                "qzeros": _pack_gptq(stored, bits, 1),
                "scales": scales,
                "g_idx": g_idx,
            },
            deq,
        )

    return write


def _fp8(per_row: bool):
    """e4m3 weights with a float32 scale per tensor ([1], compressed-tensors) or per row ([out, 1], fbgemm)."""

    def write(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1)
        scale = (amax / 448.0).float()
        q = (w / (scale if per_row else scale[0])).to(torch.float8_e4m3fn)
        parts = {"weight": q, "weight_scale": scale, "input_scale": torch.ones(1)}
        return parts, q.float() * (scale if per_row else scale[0])

    return write


_CT_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        }
    },
}

SCHEMES = {  # name -> (writer, quantization_config)
    "awq": (_awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}),
    "gptq4": (
        _gptq(4, GROUP, True),
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq",
        },
    ),
    "gptq8_v2_per_row": (
        _gptq(8, -1, False),
        {
            "quant_method": "gptq",
            "bits": 8,
            "group_size": -1,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
    ),
    "gptq4_act_order": (
        _gptq(4, 32, True, act_order=True),
        {  # groups smaller than every input size
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq",
        },
    ),
    "gptq8_act_order": (
        _gptq(8, 64, False, act_order=True),
        {
            "quant_method": "gptq",
            "bits": 8,
            "group_size": 64,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
    ),
    "fp8_tensor": (_fp8(False), _CT_FP8),
    "fp8_row": (
        _fp8(True),
        {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    ),
}


def _write(src: Path, dst: Path, ref: Path, scheme: str) -> None:
    """``dst``: the model in the scheme's layout; ``ref``: the same model holding the dequantized weights (and
    the logits head as pagedllm's int modes hold it: int8 groups of 32; FP8 leaves it float)."""
    from pagedllm.layers.quantization import Int8Linear

    writer, qc = SCHEMES[scheme]
    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quant, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            parts, deq[name] = writer(t.float())
            module = name.removesuffix(".weight")
            quant.update({f"{module}.{p}": v for p, v in parts.items()})
        elif name == "lm_head.weight" and scheme.startswith("fp8"):  # FP8 checkpoints keep their head
            quant[name] = deq[name] = t
        elif name == "lm_head.weight":
            quant[name] = t
            deq[name] = Int8Linear.from_float(t.float(), None).dequantized()[0].contiguous()
        else:
            quant[name] = deq[name] = t
    save_file(quant, str(dst / "model.safetensors"))
    save_file(deq, str(ref / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory, module_tmp) -> dict[str, tuple[Path, Path]]:
    src = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    root = module_tmp("quantized")
    for name in SCHEMES:
        _write(src, root / name, root / f"{name}-ref", name)
    return {name: (root / name, root / f"{name}-ref") for name in SCHEMES}


@pytest.fixture(scope="module")
def awq_dirs(checkpoints) -> tuple[Path, Path]:
    return checkpoints["awq"]


def test_pack_and_unpack_follow_the_nibble_order():
    q = torch.arange(16).repeat(3, 1) % 16  # [3, 16]
    packed = awq.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    assert torch.equal(awq.unpack(packed), q)
    # nibble i of a word holds column AWQ_ORDER[i]: columns 0..7 = 0..7 pack as 0x75316420
    assert packed[0, 0].item() == 0x75316420


KERNELS = [
    ("awq", "Int4Linear"),
    ("gptq4", "Int4Linear"),
    ("gptq8_v2_per_row", "Int8Linear"),
    ("gptq4_act_order", "InputPermuted"),
    ("gptq8_act_order", "InputPermuted"),
    ("fp8_tensor", "Fp8Linear"),
    ("fp8_row", "Fp8Linear"),
]


@pytest.mark.parametrize("scheme, kernel", KERNELS)
def test_blocks_hold_exactly_the_dequantized_weights(checkpoints, scheme, kernel):
    from pagedllm.layers import quantization

    tensors = load_file(str(checkpoints[scheme][0] / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj."
    parts = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
    reader = checkpoint_scheme(type("Config", (), {"quantization_config": SCHEMES[scheme][1]})())
    kind, blocks = reader.block(parts)
    if kernel == "InputPermuted":  # groups in the order the inputs were quantized in; the layer gathers into it
        *blocks, order = blocks
        inner = getattr(quantization, f"Int{kind[3:]}Linear")(*blocks, None)
        w_sorted, _ = inner.dequantized()
        w = torch.empty_like(w_sorted)
        w[:, order[0]] = w_sorted
        x = torch.randn(3, w.shape[1])
        layer = quantization.InputPermuted(inner, order[0])
        assert torch.allclose(layer(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    else:
        w, _ = getattr(quantization, kernel)(*blocks, None).dequantized()
    assert torch.allclose(w, reader.dequantize(parts), rtol=0, atol=1e-6)
    if kernel == "Fp8Linear":  # one byte a weight, held as the file has it
        assert blocks[0].dtype == torch.float8_e4m3fn and torch.equal(
            blocks[0].view(torch.uint8), parts["weight"].view(torch.uint8)
        )


@pytest.mark.parametrize("scheme, kernel", KERNELS)
def test_a_quantized_checkpoint_runs_on_our_kernels_and_matches_its_dequantized_weights(checkpoints, scheme, kernel):
    quant_dir, ref_dir = checkpoints[scheme]
    prompts = [[5, 17, 300, 4000, 12, 9, 77], [1000 + i for i in range(40)], [42] * 12]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    llm = LLM(str(quant_dir), max_model_len=256, num_gpu_blocks_override=64)
    model = llm.llm_engine.executor.worker.model
    assert type(model.layers[0].self_attn.qkv_proj).__name__ == kernel  # fused from three quantized linears
    assert type(model.layers[1].mlp.down_proj).__name__ == kernel
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    from transformers import AutoModelForCausalLM

    ref = hf_greedy(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32), prompts, 24, 5)
    check_greedy_close(
        ref,
        [o.outputs[0] for o in ours],
        topk=5,
        logprob_atol=1e-4,
        min_exact_fraction=0.9,
        names=("transformers on the dequantized weights", f"pagedllm on {scheme}"),
    )


@pytest.mark.parametrize(
    "scheme, kernel", [("awq", "Int4Linear"), ("gptq8_act_order", "InputPermuted"), ("fp8_tensor", "Fp8Linear")]
)
def test_quantized_layers_are_built_from_their_blocks_without_a_float32_copy(checkpoints, monkeypatch, scheme, kernel):
    """The layers that take their checkpoint blocks get them before any weight is read, so their float32
    weights are never made: no linear is dequantized while loading (that float32 copy of every projection
    set the load's peak memory)."""
    from pagedllm.model_loader import fp8, load_config, resolve_model, zero_point
    from pagedllm.worker.loader import load_model

    dequantized = []
    for cls in (zero_point.ZeroPointCheckpoint, fp8.FP8):
        real = cls.dequantize
        monkeypatch.setattr(cls, "dequantize", lambda self, t, real=real: dequantized.append(1) or real(self, t))
    src = resolve_model(str(checkpoints[scheme][0]))
    model = load_model(src, load_config(src), torch.float32, torch.device("cpu"))
    assert {type(model.layers[i].mlp.down_proj).__name__ for i in range(len(model.layers))} == {kernel}
    assert dequantized == []
    # a layer that cannot take its block (int8 groups under int4) is still read as float32 and rounded
    if scheme == "gptq8_act_order":
        load_model(src, load_config(src), torch.float32, torch.device("cpu"), quantization="int4")
        assert len(dequantized) == 7 * len(model.layers)


@pytest.mark.parametrize("scheme", ["awq", "gptq4_act_order"])
def test_projections_with_a_bias_take_their_blocks_and_load_the_bias(tiny_model_factory, tmp_path, monkeypatch, scheme):
    """Qwen2's q/k/v have biases: the fused projection takes its blocks before any weight is read (nothing is
    dequantized) and the checkpoint's biases then load into it; tokens and logprobs as the dequantized weights."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader import zero_point

    src = tiny_model_factory("qwen2", hidden_size=128, intermediate_size=256)
    _write(src, tmp_path / "q", tmp_path / "ref", scheme)
    real = zero_point.ZeroPointCheckpoint.dequantize
    dequantized = []
    monkeypatch.setattr(
        zero_point.ZeroPointCheckpoint, "dequantize", lambda self, t: dequantized.append(1) or real(self, t)
    )
    llm = LLM(str(tmp_path / "q"), max_model_len=256, num_gpu_blocks_override=64)
    qkv = llm.llm_engine.executor.worker.model.layers[0].self_attn.qkv_proj
    assert dequantized == [] and qkv.bias is not None and not isinstance(qkv, torch.nn.Linear)
    ref_bias = load_file(str(tmp_path / "ref" / "model.safetensors"))["model.layers.0.self_attn.k_proj.bias"]
    a = llm.llm_engine.executor.worker.model.layers[0].self_attn
    assert torch.equal(qkv.bias[a.q_size : a.q_size + a.kv_size], ref_bias.float())
    prompts = [[5, 17, 300, 4000, 12, 9, 77], [1000 + i for i in range(40)]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32), prompts, 16, 5)
    check_greedy_close(
        ref,
        [o.outputs[0] for o in ours],
        topk=5,
        logprob_atol=1e-4,
        min_exact_fraction=0.9,
        names=("transformers on the dequantized weights", f"pagedllm on {scheme}"),
    )


def test_unsupported_awq_layouts_are_refused(awq_dirs, tmp_path):
    bad = tmp_path / "gemv"
    shutil.copytree(awq_dirs[0], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="version='gemv'"):
        LLM(str(bad))
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'bitsandbytes' is not supported"):
        LLM(str(bad))
    config["quantization_config"] = {**SCHEMES["gptq4"][1], "group_size": 48}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="group_size=48"):
        LLM(str(bad))


def test_fp8_checkpoints_keep_one_byte_a_weight_and_bad_layouts_are_refused(checkpoints, tmp_path):
    quant_dir, ref_dir = checkpoints["fp8_row"]
    sizes = {}
    for name, d in (("fp8", quant_dir), ("float", ref_dir)):
        llm = LLM(str(d), max_model_len=128, num_gpu_blocks_override=16)
        layers = llm.llm_engine.executor.worker.model.layers
        sizes[name] = sum(t.numel() * t.element_size() for t in [*layers.parameters(), *layers.buffers()])
    assert sizes["fp8"] < 0.3 * sizes["float"]  # 1 byte a weight (+ a scale a row) against 4
    bad = tmp_path / "fp8"
    shutil.copytree(quant_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    for qc, words in (
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
        (
            {**_CT_FP8, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
            "'block'",
        ),
        ({**_CT_FP8, "format": "pack-quantized"}, "pack-quantized"),
    ):
        config["quantization_config"] = qc
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedModelError, match=words):
            LLM(str(bad))


def test_fp8_quantization_of_a_float_model_rounds_each_row_to_e4m3(checkpoints):
    from pagedllm.layers.quantization import Fp8Linear

    _, ref_dir = checkpoints["fp8_row"]  # a float checkpoint: quantization="fp8" rounds it here
    llm = LLM(str(ref_dir), quantization="fp8", max_model_len=128, num_gpu_blocks_override=16)
    model = llm.llm_engine.executor.worker.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert not isinstance(model.lm_head, Fp8Linear)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
