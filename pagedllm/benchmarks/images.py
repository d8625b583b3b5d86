"""The image workload of ``pagedllm bench throughput --dataset-name images`` (a vision-language model): chat
prompts of 1 or 2 random-noise images of different sizes and a text cut from the W64 text, run by pagedllm and by
transformers' own class (``AutoModelForImageTextToText`` and the checkpoint's processor, batched ``generate``).
Qwen2-VL's composite processor needs torchvision: its tokenizer and image processor stand in, as in the engine
(:class:`~pagedllm.multimodal.processing.SplitProcessor`), and ``<|image_pad|>`` is expanded here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from pagedllm.multimodal.processing import SPLIT_PROCESSOR_TYPES, SplitProcessor


def make_image_prompts(model_path: str, texts: list[list[int]], seed: int) -> list[dict]:
    """``{"prompt": chat text with one placeholder per image, "multi_modal_data": {"image": [...]}}`` for each
    text (token ids: the W64 workload's)."""
    import numpy as np
    from PIL import Image

    processor = _processor(model_path)
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    prompts = []
    for ids in texts:
        images = [
            Image.fromarray(gen.integers(0, 256, (rng.randint(32, 480), rng.randint(32, 480), 3), dtype=np.uint8))
            for _ in range(rng.randint(1, 2))
        ]
        question = processor.tokenizer.decode(ids) + "\nDescribe the pictures."
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        messages: list[Any] = [{"role": "user", "content": content}]
        if isinstance(processor, SplitProcessor):
            text = processor.tokenizer.apply_chat_template(
                messages, chat_template=processor.chat_template, tokenize=False, add_generation_prompt=True
            )
        else:
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    return prompts


def run_transformers_images(
    prompts: list[dict], output_len: int, model_path: str, batch_size: int, progress: Callable[[Any], Any]
) -> dict:
    """transformers' generate on the same prompts, ``batch_size`` at a time (left-padded); ``progress(bar)``: a
    stopping criterion that only advances the bar."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForImageTextToText

    processor = _processor(model_path)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = processor.tokenizer.pad_token_id or 0
    outputs: list[list[int]] = []
    prompt_tokens = 0
    t = time.perf_counter()
    num_batches = -(-len(prompts) // batch_size)
    with torch.inference_mode(), tqdm(total=num_batches * output_len, desc="transformers decode steps") as bar:
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            inputs: Any = (
                _split_inputs(processor, batch, pad)
                if isinstance(processor, SplitProcessor)
                else processor(
                    text=[p["prompt"] for p in batch],
                    images=[p["multi_modal_data"]["image"] for p in batch],  # a list per prompt
                    padding=True,
                    return_tensors="pt",
                )
            )
            prompt_tokens += int(inputs["attention_mask"].sum())
            out = model.generate(
                **inputs,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=progress(bar),
            )
            outputs += out[:, inputs["input_ids"].shape[1] :].tolist()
    return {"elapsed_s": time.perf_counter() - t, "outputs": outputs, "prompt_tokens": prompt_tokens}


def _processor(model_path: str) -> Any:
    """The checkpoint's processor, or its tokenizer and image processor where it needs torchvision."""
    from transformers import AutoConfig, AutoProcessor

    if AutoConfig.from_pretrained(model_path).model_type in SPLIT_PROCESSOR_TYPES:
        return SplitProcessor(model_path)
    return AutoProcessor.from_pretrained(model_path)


def _split_inputs(processor: Any, batch: list[dict], pad: int) -> dict:
    """Qwen2-VL's inputs for a batch, as its processor makes them: each ``<|image_pad|>`` expanded to its image's
    merged blocks, left-padded, with ``mm_token_type_ids``."""
    import torch

    tok, ip = processor.tokenizer, processor.image_processor
    image_id = tok.convert_tokens_to_ids(processor.image_token)
    rows, pixels, grids = [], [], []
    for p in batch:
        out = ip(p["multi_modal_data"]["image"], return_tensors="pt")
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
        counts = iter((out["image_grid_thw"].prod(-1) // ip.merge_size**2).tolist())
        row: list[int] = []
        for t in tok.encode(p["prompt"]):
            row += [image_id] * next(counts) if t == image_id else [t]
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == image_id).int(),
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
    }
