"""Load the tokenizer of a model source.

For GGUF files ``transformers`` rebuilds a fast tokenizer from the embedded
vocabulary and merges; almost all of the seconds that takes go into
``gguf.GGUFReader`` parsing ~100k vocabulary/merge strings into numpy views
(transformers' legacy config reader, used to pick the tokenizer class), so the
config is read through its fast reader instead
(:func:`~pagedllm.model_loader.gguf_loader.fast_transformers_gguf_metadata`):
a first conversion takes well under a second. The result is saved to the
pagedllm cache (see ``cache.py``) and later loads read only ``tokenizer.json``.
Whatever transformers' GGUF tokenizer does (e.g. no BOS for SmolLM2) is the
reference behaviour; the cached copy is saved and reloaded by transformers
itself, so ids, special tokens and the chat template are preserved.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from pagedllm.model_loader import cache
from pagedllm.model_loader.resolve import ModelSource, resolve_local

if TYPE_CHECKING:
    import transformers


def load_tokenizer(src: ModelSource, tokenizer: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of ``src``, or of ``tokenizer`` (a path or cached org/name) if given."""
    if tokenizer is not None:
        src = resolve_local(tokenizer, what="tokenizer")
    with cache.TRANSFORMERS_LOADS:
        if src.kind == "gguf":
            return load_gguf_tokenizer(src.path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(src.path, local_files_only=True)


# Gemma's turn format, for GGUF files that carry no chat template (Gemma 3 270M's has none): a system
# message opens the first user turn, the assistant is "model", each turn ends with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] | trim + '\n\n' -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + (system if loop.first else '') + (m['content'] or '') | trim + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
# GGUF architecture -> (chat template used where the file has none, the token that ends an assistant turn)
GGUF_CHAT_DEFAULTS = {"gemma3": (GEMMA_CHAT_TEMPLATE, "<end_of_turn>")}


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    from pagedllm.model_loader.gguf_loader import read_gguf_header

    tok = cache.load_or_build(
        "tokenizers",
        path,
        build=lambda: convert_gguf_tokenizer(path),
        save=save_tokenizer,
        load=load_saved_tokenizer,
    )
    defaults = GGUF_CHAT_DEFAULTS.get(read_gguf_header(path).architecture)
    if defaults is not None and not getattr(tok, "chat_template", None):
        tok.chat_template = defaults[0]
    return tok


def save_tokenizer(tok: transformers.PreTrainedTokenizerBase, directory: str) -> None:
    """``save_pretrained``, with the added tokens in tokenizer_config.json too: a load then reads them there
    instead of parsing the whole tokenizer.json in Python (0.2 s for Qwen2.5's 151,646 tokens)."""
    tok.save_pretrained(directory)
    config_file = os.path.join(directory, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def load_saved_tokenizer(directory: str) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer save_tokenizer wrote, through the tokenizers backend straight from its tokenizer.json (the
    pipeline as converted, bit for bit): the model's own class (Qwen2Tokenizer and the like) would rebuild it
    from the vocabulary and merges, 0.4-0.7 s more for Qwen2.5's."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)


def gguf_end_of_turn_id(path: str, tok: transformers.PreTrainedTokenizerBase) -> int | None:
    """The token id that ends an assistant turn in a GGUF model's chat format, where it is not the EOS token."""
    from pagedllm.model_loader.gguf_loader import read_gguf_header

    defaults = GGUF_CHAT_DEFAULTS.get(read_gguf_header(path).architecture)
    if defaults is None:
        return None
    token_id = tok.convert_tokens_to_ids(defaults[1])
    return token_id if isinstance(token_id, int) and token_id != tok.unk_token_id else None


def convert_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer conversion, uncached (the reference)."""
    from transformers import AutoTokenizer

    from pagedllm.model_loader.gguf_loader import (
        check_supported,
        fast_transformers_gguf_metadata,
        read_gguf_header,
    )

    # Fail fast and clearly before transformers' own (slower, vaguer) checks.
    arch = read_gguf_header(path).architecture
    check_supported(arch, path)
    with fast_transformers_gguf_metadata(arch):
        return AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
