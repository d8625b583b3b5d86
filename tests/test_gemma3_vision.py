"""Image input on Gemma 3 (``Gemma3ForConditionalGeneration``): a tiny random Gemma 3 text model (a sliding layer
of a 32-token window and a global layer) joined to a SigLIP tower and Gemma 3's pooling projector with seeded
random weights (``benchmarks/vision_models.py``'s ``build_gemma3``; the script's own default joins Gemma 3 270M's
real text weights), against transformers' class on the same directory and images.

What is checked beyond LLaVA's path: the post-layernorm, the 2x2 average pool and Gemma's norm of the projector,
and the attention of an image's tokens to each other both ways in the prompt's pass (in the sliding layer too),
which is why no prefill chunk may end inside an image.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError

from utils import (
    benchmark_module,
    check_engine_clean,
    check_greedy_close,
    check_outputs_unchanged,
    hf_greedy,
    image_chat_batch,
    make_tiny_model,
    noise_image,
)

PIL = pytest.importorskip("PIL.Image")

TOPK = 5
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=TOPK, ignore_eos=True)
SIZES = [(100, 160), (224, 224), (150, 300), (60, 400), (300, 240)]
IMAGES = [noise_image(i, size) for i, size in enumerate(SIZES)]


BATCH = image_chat_batch("<start_of_image>", IMAGES)
INPUTS = [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in BATCH]


@pytest.fixture(scope="module")
def gemma3_dir(module_tmp: Any) -> str:
    from pagedllm.model_loader import load_tokenizer, resolve_model

    vm = benchmark_module("vision_models")
    text = make_tiny_model("gemma3")
    return str(vm.build_gemma3(module_tmp("gemma3"), text, load_tokenizer(resolve_model(None))))


CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image_pil", "image_pil": IMAGES[1]},
            {"type": "image_pil", "image_pil": IMAGES[2]},
            {"type": "text", "text": "Compare these two pictures."},
        ],
    }
]


@pytest.fixture(scope="module")
def reference(gemma3_dir: str) -> list[Any]:
    """The batch, and last a chat with two images (its template rendered to token ids: each
    <start_of_image> expanded to the image's whole sequence)."""
    llm = LLM(gemma3_dir, max_model_len=1024, enable_prefix_caching=False, enable_chunked_prefill=False)
    outs = llm.generate(INPUTS, GREEDY, use_tqdm=False) + llm.chat(CHAT, GREEDY, use_tqdm=False)
    check_engine_clean(llm)
    return outs


def test_gemma3_greedy_matches_transformers_with_images_attending_both_ways(gemma3_dir: str, reference: Any) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(gemma3_dir)
    ids, extra = [], []
    for (text, images), out in zip(BATCH, reference):
        inp = processor(text=text, images=images or None, return_tensors="pt")
        ids.append(inp["input_ids"][0].tolist())
        assert list(out.prompt_token_ids) == ids[-1]  # the processor's placeholders, 16 tokens an image
        assert ids[-1].count(model.config.image_token_id) == 16 * len(images)
        extra.append({k: v for k, v in inp.items() if k not in ("input_ids", "attention_mask")} if images else {})
    chat = list(reference[-1].prompt_token_ids)  # the chat's: each image's sequence between its markers
    assert chat.count(model.config.image_token_id) == 32 and chat.count(model.config.boi_token_id) == 2
    ids.append(chat)
    extra.append(
        {
            "pixel_values": processor.image_processor(IMAGES[1:3], return_tensors="pt")["pixel_values"],
            "token_type_ids": torch.tensor([[int(t == model.config.image_token_id) for t in chat]]),
        }
    )
    assert max(len(i) for i in ids) > 2 * 32  # past the sliding layer's window
    ref = hf_greedy(model, ids, max_new_tokens=16, topk=TOPK, first_inputs=extra)
    result = check_greedy_close(
        ref, [o.outputs[0] for o in reference], TOPK, logprob_atol=1e-4, min_exact_fraction=1.0, names=("hf", "ours")
    )
    assert result.max_logprob_diff < 1e-4


def test_chunks_never_split_an_image_and_prefix_caching_and_preemption_leave_outputs_unchanged(
    gemma3_dir: str, reference: Any
) -> None:
    # 24-token chunks: each stops before an image it cannot hold whole (an image is 16 tokens with its markers)
    chunked = LLM(gemma3_dir, max_model_len=1024, max_num_batched_tokens=24)
    check_outputs_unchanged(
        reference, chunked.generate(INPUTS, GREEDY, use_tqdm=False) + chunked.chat(CHAT, GREEDY, use_tqdm=False)
    )
    # from the prefix cache, chunks starting mid-image
    again = chunked.generate(INPUTS, GREEDY, use_tqdm=False) + chunked.chat(CHAT, GREEDY, use_tqdm=False)
    check_outputs_unchanged(reference, again)
    assert all(o.num_cached_tokens > 0 for o, (_, im) in zip(again, BATCH + [("", IMAGES[1:3])]) if im)
    check_engine_clean(chunked)
    del chunked
    tight = LLM(
        gemma3_dir,
        max_model_len=96,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=14,
    )
    check_outputs_unchanged(
        reference, tight.generate(INPUTS, GREEDY, use_tqdm=False) + tight.chat(CHAT, GREEDY, use_tqdm=False)
    )
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    check_engine_clean(tight)


def test_gemma3_refuses_what_it_cannot_do_by_name(gemma3_dir: str) -> None:
    with pytest.raises(InvalidParameterError, match="max_num_batched_tokens"):
        LLM(gemma3_dir, max_model_len=1024, max_num_batched_tokens=8)
    llm = LLM(gemma3_dir, max_model_len=512, num_gpu_blocks_override=64)
    with pytest.raises(InvalidParameterError, match="one <start_of_image>") as e:
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    assert e.value.param == "multi_modal_data.image"
    check_engine_clean(llm)
