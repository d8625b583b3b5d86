"""AWQ checkpoints (AutoAWQ's GEMM layout), written here by the format's rules since none can be downloaded:
they load into the int4 kernels without a second rounding and compute what their dequantized weights do."""

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
from utils import check_greedy_close, hf_greedy

GROUP = 128
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's asymmetric 4-bit rounding of W [out, in] in groups along in: (qweight, qzeros, scales)."""
    out, k = w.shape
    g = w.t().reshape(k // GROUP, GROUP, out)  # [groups, group, out]
    lo, hi = g.amin(dim=1), g.amax(dim=1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(g / s[:, None]) + zeros[:, None], 0, 15).reshape(k, out)
    return awq.pack(q), awq.pack(zeros), scales


def _write(src: Path, dst: Path, ref: Path) -> None:
    """``dst``: the model in AWQ's layout; ``ref``: the same model holding the dequantized weights (and the
    logits head as pagedllm's quantized modes hold it: int8 groups of 32)."""
    from pagedllm.layers.quantization import Int8Linear

    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quant, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            qweight, qzeros, scales = _quantize(t.float())
            module = name.removesuffix(".weight")
            quant.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales})
            deq[name] = awq.dequantize(qweight, qzeros, scales, GROUP)
        elif name == "lm_head.weight":
            quant[name] = t
            deq[name] = Int8Linear.from_float(t.float(), None).dequantized()[0].contiguous()
        else:
            quant[name] = deq[name] = t
    save_file(quant, str(dst / "model.safetensors"))
    save_file(deq, str(ref / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def awq_dirs(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    src = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    root = tmp_path_factory.mktemp("awq")
    _write(src, root / "awq", root / "ref")
    return root / "awq", root / "ref"


def test_pack_and_unpack_follow_the_nibble_order():
    q = torch.arange(16).repeat(3, 1) % 16  # [3, 16]
    packed = awq.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    assert torch.equal(awq.unpack(packed), q)
    # nibble i of a word holds column AWQ_ORDER[i]: columns 0..7 = 0..7 pack as 0x75316420
    assert packed[0, 0].item() == 0x75316420


def test_int4_blocks_hold_exactly_the_dequantized_weights(awq_dirs):
    from pagedllm.layers.quantization import Int4Linear

    tensors = load_file(str(awq_dirs[0] / "model.safetensors"))
    parts = [tensors[f"model.layers.1.mlp.down_proj.{p}"] for p in ("qweight", "qzeros", "scales")]
    lin = Int4Linear(*awq.int4_blocks(*parts, GROUP), None)
    w, _ = lin.dequantized()
    assert torch.allclose(w, awq.dequantize(*parts, GROUP), rtol=0, atol=1e-6)


def test_an_awq_checkpoint_runs_on_the_int4_kernels_and_matches_its_dequantized_weights(awq_dirs):
    from pagedllm.layers.quantization import Int4Linear

    awq_dir, ref_dir = awq_dirs
    prompts = [[5, 17, 300, 4000, 12, 9, 77], [1000 + i for i in range(40)], [42] * 12]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    llm = LLM(str(awq_dir), max_model_len=256, num_gpu_blocks_override=64)
    model = llm.llm_engine.executor.worker.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)  # fused from three AWQ linears
    assert isinstance(model.layers[1].mlp.down_proj, Int4Linear)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    from transformers import AutoModelForCausalLM

    ref = hf_greedy(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32), prompts, 24, 5)
    check_greedy_close(ref, [o.outputs[0] for o in ours], topk=5, logprob_atol=1e-4, min_exact_fraction=0.9,
                       names=("transformers on the dequantized weights", "pagedllm on AWQ"))


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
