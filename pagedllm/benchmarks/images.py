"""The image workload of ``pagedllm bench throughput --dataset-name images`` (a vision-language model): chat
prompts of 1 or 2 random-noise images of different sizes and a text cut from the W64 text, run by pagedllm and by
transformers' own class (``AutoModelForImageTextToText`` and the checkpoint's processor, batched ``generate``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any


def make_image_prompts(model_path: str, texts: list[list[int]], seed: int) -> list[dict]:
    """``{"prompt": chat text with one placeholder per image, "multi_modal_data": {"image": [...]}}`` for each
    text (token ids: the W64 workload's)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
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
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    return prompts


def run_transformers_images(
    prompts: list[dict], output_len: int, model_path: str, batch_size: int, progress: Callable[[Any], Any]
) -> dict:
    """transformers' generate on the same prompts, ``batch_size`` at a time (left-padded); ``progress(bar)``: a
    stopping criterion that only advances the bar."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
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
            inputs: Any = processor(
                text=[p["prompt"] for p in batch],
                images=[im for p in batch for im in p["multi_modal_data"]["image"]],
                padding=True,
                return_tensors="pt",
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
