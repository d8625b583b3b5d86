"""Image input on Qwen2-VL and Qwen2.5-VL checkpoints: SmolLM2-135M's real text weights as a Qwen2-VL text model
(q/k/v biases zero, M-RoPE over its 64-wide heads) joined to a Qwen2-VL (or Qwen2.5-VL) tower and patch merger
with seeded random weights (``benchmarks/vision_models.py qwen2_vl``), against transformers' class on the same
directory and the same images.

What is checked beyond LLaVA's path: images at their own resolution (each size its own grid and token count),
the 2-D rotary positions inside the tower, the 2×2 patch merge, Qwen2.5-VL's windowed blocks, and M-RoPE
positions in the text model for the prompt's image and text tokens and for every decoded token after them. An
answer cannot describe an image: the tower's weights are random.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams

from utils import (
    benchmark_module,
    check_engine_clean,
    check_greedy_close,
    check_outputs_unchanged,
    hf_greedy,
    image_chat_batch,
    noise_image,
)

PIL = pytest.importorskip("PIL.Image")

TOPK = 5
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=TOPK, ignore_eos=True)
# (height, width): each a different grid of 28-pixel blocks, from 2x14 to 11x9
SIZES = [(100, 160), (224, 224), (150, 300), (60, 400), (300, 240)]
IMAGES = [noise_image(i, size) for i, size in enumerate(SIZES)]
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"


def _chat(num_images: int, question: str) -> str:
    return f"<|im_start|>user\n{IMAGE_PART * num_images}{question}<|im_end|>\n<|im_start|>assistant\n"


BATCH = image_chat_batch(IMAGE_PART, IMAGES)
INPUTS = [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in BATCH]


@pytest.fixture(scope="module")
def qwen2_vl_dir(module_tmp: Any, smollm2_text_model: Any) -> str:
    vm = benchmark_module("vision_models")
    return str(vm.build_qwen2_vl(module_tmp("qwen2_vl"), text_model=smollm2_text_model))


@pytest.fixture(scope="module")
def reference(qwen2_vl_dir: str) -> tuple[list[Any], LLM]:
    """Our outputs with every scheduler feature off and room for the whole batch in one step."""
    llm = LLM(qwen2_vl_dir, max_model_len=1024, enable_prefix_caching=False, enable_chunked_prefill=False)
    outs = llm.generate(INPUTS, GREEDY, use_tqdm=False)
    check_engine_clean(llm)
    return outs, llm


def _matches_transformers(path: str, outs: list[Any]) -> None:
    """``outs`` (greedy, BATCH) against transformers' class on ``path``: the same image tokens, the same
    tokens and logprobs."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    image_processor = AutoImageProcessor.from_pretrained(path)
    image_token = model.config.image_token_id
    ids, extra, deltas = [], [], []
    for (_, images), out in zip(BATCH, outs):
        prompt = list(out.prompt_token_ids)
        ids.append(prompt)
        if not images:
            extra.append({})
            continue
        inp = image_processor(images, return_tensors="pt")
        # a token per merged 2x2 block of each image's own grid, as Qwen2VLProcessor expands <|image_pad|>
        assert prompt.count(image_token) == int((inp["image_grid_thw"].prod(-1) // 4).sum())
        types = torch.tensor([[int(t == image_token) for t in prompt]])
        extra.append({**inp, "mm_token_type_ids": types})
        _, delta = model.model.get_rope_index(torch.tensor([prompt]), types, inp["image_grid_thw"])
        deltas.append(int(delta))
    assert min(deltas) < -20  # the images' positions are far from the tokens': M-RoPE is what is compared
    ref = hf_greedy(model, ids, max_new_tokens=16, topk=TOPK, first_inputs=extra)
    result = check_greedy_close(
        ref, [o.outputs[0] for o in outs], TOPK, logprob_atol=1e-4, min_exact_fraction=1.0, names=("hf", "ours")
    )
    assert result.max_logprob_diff < 1e-4


def test_qwen2_vl_greedy_matches_transformers_with_m_rope_on_images_of_every_size(
    qwen2_vl_dir: str, reference: Any
) -> None:
    _matches_transformers(qwen2_vl_dir, reference[0])


def test_qwen2_5_vl_windowed_tower_matches_transformers_also_in_chunks(tmp_path: Path, smollm2_text_model: Any) -> None:
    """Qwen2.5-VL's tower: RMSNorm and gated-MLP blocks, two of four attending within windows of 2x2 merged
    tokens (every image here spans several, the edge ones cut short); the text side is Qwen2-VL's."""
    vm = benchmark_module("vision_models")
    path = str(vm.build_qwen2_vl(tmp_path / "qwen2_5_vl", text_model=smollm2_text_model, version="2.5"))
    llm = LLM(path, max_model_len=1024, enable_prefix_caching=False, enable_chunked_prefill=False)
    outs = llm.generate(INPUTS, GREEDY, use_tqdm=False)
    _matches_transformers(path, outs)
    del llm
    chunked = LLM(path, max_model_len=1024, max_num_batched_tokens=32)
    again = chunked.generate(INPUTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    check_engine_clean(chunked)


def test_token_id_prompts_and_chat_image_parts_give_the_same_tokens(qwen2_vl_dir: str, reference: Any) -> None:
    outs, llm = reference
    text, images = BATCH[2]
    tokenizer = llm.get_tokenizer()
    short = tokenizer.encode(text, add_special_tokens=False)
    by_ids = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    buf = io.BytesIO()
    images[1].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": images[0]},
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Compare these two pictures."},
                ],
            }
        ],
        GREEDY,
        use_tqdm=False,
    )
    for got in (by_ids[0], chat[0]):
        assert list(got.prompt_token_ids) == list(outs[2].prompt_token_ids)
        assert got.outputs[0].token_ids == outs[2].outputs[0].token_ids
    check_engine_clean(llm)


def test_chunked_prefill_preemption_prefix_caching_and_n_leave_outputs_unchanged(
    qwen2_vl_dir: str, reference: Any
) -> None:
    ref = reference[0]

    # chunks of 32 tokens: images and the M-RoPE positions after them span chunks
    chunked = LLM(qwen2_vl_dir, max_model_len=1024, enable_prefix_caching=False, max_num_batched_tokens=32)
    check_outputs_unchanged(ref, chunked.generate(INPUTS, GREEDY, use_tqdm=False))
    check_engine_clean(chunked)
    del chunked

    # too few blocks for the batch: requests are preempted and computed again
    tight = LLM(
        qwen2_vl_dir,
        max_model_len=384,
        enable_prefix_caching=False,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=24,
    )
    check_outputs_unchanged(ref, tight.generate(INPUTS, GREEDY, use_tqdm=False))
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    check_engine_clean(tight)
    del tight

    # prefix caching, twice over (the second pass from the cache), and n=2 siblings
    cached = LLM(qwen2_vl_dir, max_model_len=1024, max_num_batched_tokens=48, encoder_cache_size=4096)
    check_outputs_unchanged(ref, cached.generate(INPUTS, GREEDY, use_tqdm=False))
    again = cached.generate(INPUTS, GREEDY, use_tqdm=False)
    check_outputs_unchanged(ref, again)
    assert all(o.num_cached_tokens > 0 for o, (_, im) in zip(again, BATCH) if im)
    two = cached.generate(INPUTS[:1], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4), use_tqdm=False)
    assert len(two[0].outputs) == 2
    assert cached.llm_engine.core.scheduler.encoder_cache.num_encoded == len(IMAGES)
    check_engine_clean(cached)


def test_prefix_cache_reuses_an_image_and_never_shares_another(qwen2_vl_dir: str) -> None:
    llm = LLM(qwen2_vl_dir, max_model_len=1024)
    text = _chat(1, "Look at this picture closely and then tell me, in as much detail as you can, " * 6)
    first, same, other = (
        llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
        for image in (IMAGES[1], IMAGES[1], IMAGES[1].transpose(PIL.Transpose.FLIP_LEFT_RIGHT))
    )
    n = len(first.prompt_token_ids)
    assert same.num_cached_tokens >= 0.9 * n
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    image_at = list(first.prompt_token_ids).index(llm.llm_engine.mm_processor.image_token_id)
    assert other.num_cached_tokens <= image_at  # the same size and grid, other pixels: not one image block shared
    assert other.outputs[0].logprobs != first.outputs[0].logprobs
    check_engine_clean(llm)


def test_pipeline_parallelism_gives_one_process_tokens(qwen2_vl_dir: str, reference: Any) -> None:
    """The first stage holds the tower and embeds; every stage's runner computes the M-RoPE positions."""
    outs, _ = reference
    llm = LLM(
        qwen2_vl_dir,
        max_model_len=1024,
        enable_prefix_caching=False,
        num_gpu_blocks_override=128,
        pipeline_parallel_size=2,
    )
    try:
        got = llm.generate(INPUTS[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids[:8] for o in outs[:4]]
    finally:
        llm.llm_engine.shutdown()


def test_bad_images_and_placeholders_are_refused_by_name(reference: Any) -> None:
    from pagedllm.errors import InvalidParameterError

    outs, llm = reference
    text = _chat(1, "What is this?")
    with pytest.raises(InvalidParameterError) as e:  # the image processor's own limit: an aspect ratio over 200
        llm.generate({"prompt": text, "multi_modal_data": {"image": PIL.new("RGB", (3000, 10))}}, GREEDY)
    assert e.value.param == "multi_modal_data.image"
    with pytest.raises(InvalidParameterError, match="placeholders do not match"):
        llm.generate({"prompt": _chat(2, "Two?"), "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    with pytest.raises(InvalidParameterError, match="no image"):
        llm.generate(text, GREEDY)
    again = llm.generate(INPUTS[:1], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    check_engine_clean(llm)
