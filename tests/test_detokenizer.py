"""Incremental detokenization and stop strings, fed token by token through the OutputProcessor."""

from __future__ import annotations

import itertools

import pytest

from pagedllm.engine.core import EngineCoreOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is plain ASCII.",
    "Café crème brûlée — naïve façade.",
    "你好，世界！这是一个测试。",
    "Emoji: 🦙🔥👍🏽 and flags 🇫🇷 mixed with text",
    "  leading spaces,\ttabs\nand newlines\n\n",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def _stream(tok, text, sp, prompt="Say:"):
    """Feed the text's tokens one at a time; return (RequestOutputs, ids fed, stop requests)."""
    sp.bind_eos(frozenset())
    ids = tok.encode(text, add_special_tokens=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    req = Request("r", prompt_ids, sp, max_tokens=len(ids))
    op = OutputProcessor(tok)
    op.add_request("r", [req], prompt)
    outs, stops = [], []
    for i, t in enumerate(ids):
        req.append_output_token(t)
        if i == len(ids) - 1:
            req.status = RequestStatus.FINISHED_LENGTH
        res, to_stop = op.process([EngineCoreOutput(req, [t])])
        outs += res
        stops += to_stop
        if to_stop:
            break
    return outs, ids, stops


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(tok, text):
    outs, ids, _ = _stream(tok, text, SamplingParams(max_tokens=100))
    texts = [o.outputs[0].text for o in outs]
    deltas = [b[len(a) :] for a, b in zip([""] + texts, texts)]
    assert all(b.startswith(a) for a, b in zip([""] + texts, texts)), "cumulative text must only grow"
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in t for t in texts[:-1]) or "\ufffd" in tok.decode(ids)


def test_multibyte_characters_split_across_byte_tokens_are_held_back(tok):
    text = "🦙🔥"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2, "each emoji should need several byte-level tokens"
    outs, _, _ = _stream(tok, text, SamplingParams())
    assert [o.outputs[0].text for o in outs][-1] == text
    assert all("\ufffd" not in o.outputs[0].text for o in outs)


@pytest.mark.parametrize(
    "text, stops, include, expect",
    [
        ("The answer is forty-two. Done.", ["forty-two"], False, "The answer is "),
        ("The answer is forty-two. Done.", ["forty-two"], True, "The answer is forty-two"),
        ("Café crème brûlée — naïve.", ["brûlée"], False, "Café crème "),
        ("你好，世界！这是一个测试。", ["世界"], True, "你好，世界"),
        ("alpha beta gamma delta", ["delta", "beta", "gamma"], False, "alpha "),  # earliest of several wins
        ("one\n\ntwo", ["\n\n"], False, "one"),
    ],
)
def test_stop_strings_across_token_boundaries(tok, text, stops, include, expect):
    outs, _, to_stop = _stream(tok, text, SamplingParams(stop=stops, include_stop_str_in_output=include))
    final = outs[-1]
    assert final.finished and final.outputs[0].text == expect
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason in stops
    assert to_stop and to_stop[0][1] == final.outputs[0].stop_reason
    streamed = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(streamed)), "a stop string's prefix was streamed"


def test_stop_string_spanning_many_tokens_is_never_partially_streamed(tok):
    stop = "STOP HERE NOW"
    outs, _, _ = _stream(tok, f"some words then {stop} and more", SamplingParams(stop=[stop]))
    for o in outs[:-1]:
        assert "STOP" not in o.outputs[0].text
    assert outs[-1].outputs[0].text == "some words then "


def _run_kind(tok, kind, text="Café 🦙 says hello to 你好 friends"):
    return _stream(tok, text, SamplingParams(output_kind=kind))[0]


def test_delta_outputs_concatenate_to_the_cumulative_output(tok):
    cumulative = _run_kind(tok, "cumulative")
    delta = _run_kind(tok, "delta")
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text
    assert [t for o in delta for t in o.outputs[0].token_ids] == cumulative[-1].outputs[0].token_ids
    final_only = _run_kind(tok, "final_only")
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].text == cumulative[-1].outputs[0].text


# slow-tokenizer rule: specials and the text runs between them joined by " " (" there" keeps its own space)
@pytest.mark.parametrize(
    "spaces, expect", [(True, "Hi <|im_end|> <|im_start|>  there"), (False, "Hi<|im_end|><|im_start|> there")]
)
def test_spaces_between_special_tokens(tok, spaces, expect):
    text = "Hi<|im_end|><|im_start|> there"
    outs, _, _ = _stream(tok, text, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces))
    assert outs[-1].outputs[0].text == expect
    streamed = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(streamed))
    skipped, _, _ = _stream(tok, text, SamplingParams(spaces_between_special_tokens=spaces))
    assert skipped[-1].outputs[0].text == "Hi there"
