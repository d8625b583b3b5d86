"""Bad input gets a clear, typed error, and the engine keeps serving everyone else."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError, ModelNotFoundError, PromptTooLongError, UnsupportedModelError


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=64)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _assert_clean(llm):
    core = llm.llm_engine.core
    core.scheduler.check_invariants()
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_sampling_values_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param in str(e.value)


def test_unknown_sampling_option_is_rejected_not_ignored():
    with pytest.raises(TypeError, match="guided_decoding"):
        SamplingParams(guided_decoding={"json": {}})


def test_prompt_longer_than_context_says_both_numbers(llm):
    with pytest.raises(PromptTooLongError, match=r"200 tokens.*128"):
        llm.generate([{"prompt_token_ids": [5] * 200}], GREEDY, use_tqdm=False)
    _assert_clean(llm)


@pytest.mark.parametrize(
    "prompt",
    ["", {"prompt_token_ids": []}, {"prompt_token_ids": [1, 10**9]}, {"prompt_token_ids": [-1]}, {"nope": 1}, 42],
)
def test_empty_or_malformed_prompt_is_rejected(llm, prompt):
    with pytest.raises(InvalidParameterError):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    _assert_clean(llm)


def test_logprobs_above_configured_max(llm):
    with pytest.raises(InvalidParameterError, match="max_logprobs"):
        llm.generate(["hi"], SamplingParams(logprobs=21), use_tqdm=False)


def test_bad_request_in_a_batch_leaves_engine_serving_others(llm):
    good = ["Hello there", "How are you?"]
    before = llm.generate(good, GREEDY, use_tqdm=False)
    with pytest.raises(PromptTooLongError):
        llm.generate(good + [{"prompt_token_ids": [7] * 500}], GREEDY, use_tqdm=False)
    _assert_clean(llm)
    after = llm.generate(good, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    _assert_clean(llm)


def test_nonexistent_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_unknown_engine_argument_is_named():
    with pytest.raises(InvalidParameterError, match="max_num_seq'"):
        LLM(max_num_seq=4)


def test_unsupported_parallelism_is_refused_not_ignored():
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=2)


def test_max_model_len_larger_than_kv_cache_is_refused(tiny_llama_dir):
    with pytest.raises(InvalidParameterError, match="KV cache can hold"):
        LLM(model=tiny_llama_dir, max_model_len=512, num_gpu_blocks_override=4)


def test_a_kv_cache_larger_than_the_machine_maps_is_a_clear_error(tiny_llama_dir):
    # more than the memory available: refused before anything is allocated
    with pytest.raises(InvalidParameterError, match=r"kv_cache_memory asks for .* GiB KV cache, but only") as e:
        LLM(model=tiny_llama_dir, kv_cache_memory=10**30)
    assert e.value.param == "kv_cache_memory"
    # a block count that no budget checked: the allocation itself fails, clearly
    with pytest.raises(InvalidParameterError, match=r"could not be allocated.*lower kv_cache_memory") as e:
        LLM(model=tiny_llama_dir, num_gpu_blocks_override=10**15)
    assert e.value.param == "kv_cache_memory"


def test_unsupported_architecture_lists_supported_ones(tiny_llama_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "weird"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"FalconForCausalLM.*LlamaForCausalLM"):
        LLM(model=str(d))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_rejected(llm, kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(["hi"], SamplingParams(**kwargs), use_tqdm=False)
    assert e.value.param == param
    _assert_clean(llm)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"logit_bias": {5: 200.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_invalid_penalty_and_bias_values(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
