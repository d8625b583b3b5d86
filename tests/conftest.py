"""Session-scoped fixtures: SmolLM2's tokenizer, tiny random-weight models, the transformers GGUF oracle.

The tiny models are real transformers checkpoints (config + float32 safetensors
+ SmolLM2's tokenizer) with random weights, one per architecture family the
engine claims to run. Each exercises the feature that family adds:

==============  =====================================================  ========
name            what it covers                                         tied
==============  =====================================================  ========
llama           GQA, head_dim (32) != hidden / heads (16)              no
llama3_rope     llama3 rope scaling over positions 0..~200             yes
qwen2           nonzero q/k/v biases                                   no
qwen3           q/k RMSNorm with non-trivial weights                   yes
mistral         sliding_window=32, shorter than most test prompts      no
==============  =====================================================  ========

Weights are drawn with ``initializer_range=0.2`` (not 0.02) so the logits are far
from uniform and greedy decoding has clear winners to compare.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_VOCAB_SIZE = 49152  # SmolLM2's tokenizer

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# name -> (transformers config class name, config fields on top of _COMMON)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(head_dim=32, tie_word_embeddings=False)),
    "llama3_rope": ("LlamaConfig", dict(
        head_dim=16, tie_word_embeddings=True,
        # original context 64: wavelengths span all three llama3 bands (kept, smoothed, divided by factor)
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=32, tie_word_embeddings=False)),
}
TINY_MODEL_NAMES = list(TINY_MODELS)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding SmolLM2's tokenizer (from the embedded GGUF), saved with ``save_pretrained``."""
    from pagedllm.model_loader import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


def build_tiny_model(path: Path, name: str, tokenizer_dir: Path | None = None, seed: int = 0,
                     **config_overrides: Any) -> Path:
    """Write tiny random model ``name`` (a key of TINY_MODELS) to ``path``: config, fp32 safetensors, tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, fields = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**{**_COMMON, **fields, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # RMSNorm weights (q/k norms included) away from the all-ones init
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory,
                       smollm2_tokenizer_dir: Path) -> Callable[..., Path]:
    """``make(name, **config_overrides) -> Path``: a tiny model dir, built once per session per arguments."""
    built: dict[tuple, Path] = {}

    def make(name: str, **config_overrides: Any) -> Path:
        key = (name, tuple(sorted((k, repr(v)) for k, v in config_overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            built[key] = build_tiny_model(path, name, smollm2_tokenizer_dir, **config_overrides)
        return built[key]

    return make


@pytest.fixture(scope="session", params=TINY_MODEL_NAMES)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """Every tiny model in turn: a test using this fixture runs once per name in TINY_MODEL_NAMES."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def smollm2_hf_model() -> Any:
    """transformers' own model from the embedded SmolLM2 GGUF, in float32 (slow to load: ~30 s)."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()
