"""Beam search against transformers' generate(num_beams=...) on the same tiny model."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams

PROMPTS = [[300, 301, 302, 303], [1000, 2000, 3000], list(range(500, 540))]


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    base = str(tiny_model_factory("llama"))
    # make an EOS that beams actually meet: a token the model likes early on
    greedy = (
        LLM(model=base, max_model_len=256, num_gpu_blocks_override=64)
        .generate(
            [{"prompt_token_ids": PROMPTS[0]}],
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    eos = greedy[1]
    model_dir = str(tiny_model_factory("llama", eos_token_id=eos))
    llm = LLM(model=model_dir, max_model_len=256, num_gpu_blocks_override=256)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos_ids = sorted(llm.llm_engine.processor.eos_token_ids)
    assert eos in eos_ids
    return llm, hf, eos_ids


@pytest.mark.parametrize(
    "width, length_penalty, early_stopping, max_tokens",
    [
        (3, 1.0, False, 8),
        (4, 2.0, True, 8),
        (2, 0.5, "never", 10),
        (3, -1.0, False, 6),
    ],
)
def test_beam_search_matches_transformers(setup, width, length_penalty, early_stopping, max_tokens):
    llm, hf, eos_ids = setup
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS],
        BeamSearchParams(
            beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping
        ),
    )
    saw_eos = False
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=width,
                num_return_sequences=width,
                max_new_tokens=max_tokens,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=eos_ids[0],
                return_dict_in_generate=True,
                output_scores=True,
            )
        ref_seqs = []
        for seq in ref.sequences.tolist():
            gen = seq[len(prompt) :]
            for i, t in enumerate(gen):  # HF pads finished beams after their EOS
                if t in eos_ids:
                    gen = gen[: i + 1]
                    break
            ref_seqs.append(gen)
        ours = [s.tokens[len(prompt) :] for s in out.sequences]
        assert ours == ref_seqs
        assert [s.score for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
        saw_eos |= any(s.finish_reason == "stop" for s in out.sequences)
    if length_penalty < 0:  # favours short hypotheses: the EOS-finished ones must win here
        assert saw_eos, "the test should exercise finished-by-EOS hypotheses"
    s = llm.llm_engine.core.scheduler
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def test_beam_search_validates_its_parameters():
    from pagedllm.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidParameterError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
