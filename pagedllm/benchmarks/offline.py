"""`pagedllm bench throughput|latency`: pagedllm vs transformers, side by side in one process.

Standard workload W64: 64 prompts whose lengths are drawn with random.Random(0).randint(32, 512),
cut by token count from fixed English text at different offsets (no shared prefixes),
128 greedy output tokens each, EOS ignored. transformers runs the same token ids as one
left-padded static batch.

    pagedllm bench throughput                                  # default model, W64, both engines
    pagedllm bench throughput --num-prompts 8 --output-len 32 --backend pagedllm
    pagedllm bench latency                                     # one 128-token prompt, 128 new tokens
    pagedllm bench latency --quantization int4                 # pagedllm int4 vs transformers float32
    pagedllm bench accuracy --quantization int8                # greedy agreement, same top, perplexity vs fp32
    pagedllm bench accuracy --kv-cache-dtype int8 --reference-kv-cache-dtype bfloat16 \
        --context-lengths 8192,30720                           # a KV cache dtype against another, long prompts
    pagedllm bench latency --dataset copy --backend spec-vs-off \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'   # speculation on vs off
    pagedllm bench throughput --num-prompts 16 --backend structured-vs-off  # every request under a JSON
        # schema (--structured-outputs '{"json": {...}}' for another) vs none; compile times cold and cached
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import sys
import time

TEXT = (
    "The history of the river town begins with a ford, a place where the water ran shallow enough for "
    "carts to cross in late summer. Traders came first, then farmers who cleared the slopes for orchards, "
    "and finally the millers who dammed the stream and built the wheels that would turn for two centuries. "
    "Each generation left a layer on the streets: cobbles over gravel, brick over timber, tram rails over "
    "cobbles, and asphalt over everything. Children learned to read in a schoolhouse that had been a "
    "granary; the library was once a customs post, and its reading room still has the iron grille where "
    "tolls were paid. In the floods of the wet years the river climbed the steps of the church and left a "
    "line of silt that no one painted over, so visitors can still see how high it came. Scientists who "
    "study such towns measure the width of the old walls, count the rings of the beams, and compare the "
    "registers of births and burials to reconstruct how many people lived there in each decade. They find "
    "that the population rose when the railway arrived, fell when the mills closed, and rose again when "
    "the town became a place where people from the city wanted to spend their weekends, walking along "
    "the towpath, eating in the old inns, and buying bread from bakeries that use the same ovens as their "
    "great-grandparents did. A careful engineer would note that the bridge was rebuilt three times, that "
    "the dam leaks a little every spring, and that the sluice gates are opened by hand with a wheel that "
    "takes two strong people to turn. Nothing here is fast, and that is exactly why people come."
)


def make_copy_prompt(tokenizer, input_len: int) -> list[int]:
    """A chat prompt whose answer quotes it: "repeat this text", with input_len tokens of TEXT to repeat."""
    text = tokenizer.decode(tokenizer.encode(TEXT, add_special_tokens=False)[:input_len])
    messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{text}"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(chat, add_special_tokens=False)


def spec_report(llm) -> dict | None:
    """Acceptance since the last call: rate, mean tokens per verification step, per-position rates."""
    st = llm.llm_engine.core.make_stats().spec_decode
    if st is None:
        return None
    return {
        "num_drafts": st.num_drafts,
        "num_draft_tokens": st.num_draft_tokens,
        "num_accepted_tokens": st.num_accepted_tokens,
        "acceptance_rate": st.num_accepted_tokens / max(st.num_draft_tokens, 1),
        "mean_accepted_length": 1 + st.num_accepted_tokens / max(st.num_drafts, 1),
        "acceptance_per_position": [n / max(st.num_drafts, 1) for n in st.accepted_per_pos],
    }


def make_w64(tokenizer, num_prompts: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    base = tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = []
    for i, n in enumerate(lengths):
        start = (i * 37) % len(base)  # a different offset per prompt: no shared prefixes
        ids: list[int] = []
        while len(ids) < n:
            ids += base[start:] + base
            start = 0
        prompts.append(ids[:n])
    return prompts


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# The default schema of `--backend structured-vs-off`: long enough (20+ records) that no answer completes it
# within the usual output lengths, so both sides generate the same number of tokens.
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 20,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    },
}


def make_random_adapters(model: str | None, num: int, rank: int, root: str, seed: int = 0) -> list:
    """``num`` PEFT-format LoRA adapters of ``rank`` over every projection of the model, random weights
    (scaled so each changes the outputs without wrecking them), written under ``root``."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.lora import LoRARequest
    from pagedllm.lora.adapter import ADAPTABLE
    from pagedllm.lora.manager import part_shapes
    from pagedllm.model_loader import load_config, resolve_model

    src = resolve_model(model)
    cfg = load_config(src)
    shapes = part_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(num):
        path = os.path.join(root, f"adapter{k}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for i in range(cfg.num_hidden_layers):
            for proj, (fused, part) in ADAPTABLE.items():
                o, n = shapes[fused][part]
                block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
                stem = f"base_model.model.model.layers.{i}.{block}.{proj}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n, generator=gen) / n**0.5
                tensors[f"{stem}.lora_B.weight"] = torch.randn(o, rank, generator=gen) * (0.02 / rank**0.5)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": rank,
                    "target_modules": list(ADAPTABLE),
                    "bias": "none",
                    "base_model_name_or_path": src.name,
                },
                f,
            )
        out.append(LoRARequest(f"adapter{k}", k + 1, path))
    return out


def run_pagedllm(
    prompts, output_len: int, engine_kwargs: dict, structured: dict | None = None, loras: list | None = None
) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, structured_outputs=structured)
    # warm-up (with a constraint, the grammar backend's one-time set-up too: reported apart)
    llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}],
        SamplingParams(max_tokens=2, structured_outputs={"regex": "[a-z]+"} if structured else None),
        use_tqdm=False,
    )
    if structured:
        llm.llm_engine.structured.compile_seconds.clear()
    t = time.perf_counter()
    spec_report(llm)  # drop the warm-up's counts
    outs = llm.generate(
        [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=True,
        lora_request=[loras[i % len(loras)] for i in range(len(prompts))] if loras else None,
    )
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    spec = spec_report(llm)
    grammar = grammar_report(llm) if structured else None
    comm = comm_report(llm)
    preemptions = llm.llm_engine.core.scheduler.num_preemptions
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return {
        "elapsed_s": elapsed,
        "outputs": tokens,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "spec_decode": spec,
        "structured_outputs": grammar,
        "communication": comm,
        "preemptions": preemptions,
    }


def comm_report(llm) -> dict | None:
    """Bytes per computed token each rank all-reduced (TP), gathered (logits) and sent on (PP)."""
    pc = llm.llm_engine.config.parallel_config
    if pc.world_size == 1:
        return None
    ranks = llm.llm_engine.executor.collective_rpc("comm_stats")
    return {
        "per_rank_bytes_per_token": [
            {k: round(r[k] / max(r["tokens"], 1), 1) for k in ("all_reduce", "gather", "send")} for r in ranks
        ],
        "tokens_computed": ranks[0]["tokens"],
    }


def grammar_report(llm) -> dict:
    """Compile times of the run: the cold compiles and the requests served from the compile cache."""
    import statistics

    events = llm.llm_engine.structured.make_stats()["compile_seconds"]
    cold = [s for s, hit in events if not hit]
    cached = [s for s, hit in events if hit]
    return {
        "backend": llm.llm_engine.structured.backend_name,
        "backend_setup_s": llm.llm_engine.structured.backend_init_seconds,
        "cold_compiles": len(cold),
        "cold_compile_s": max(cold) if cold else None,
        "cache_hits": len(cached),
        "cached_compile_s_median": statistics.median(cached) if cached else None,
    }


def run_transformers(prompts, output_len: int, model_path: str | None, batch_size: int) -> dict:
    import torch
    from tqdm.auto import tqdm

    model = _load_transformers(model_path)
    pad = 0
    t = time.perf_counter()
    outputs = []
    num_batches = -(-len(prompts) // batch_size)
    with torch.inference_mode(), tqdm(total=num_batches * output_len, desc="transformers decode steps") as bar:
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=_progress(bar),
            )
            outputs += out[:, width:].tolist()
    elapsed = time.perf_counter() - t
    return {"elapsed_s": elapsed, "outputs": outputs}


def run_latency(
    model: str | None,
    input_len: int,
    output_len: int,
    iters: int,
    warmup: int,
    backend: str,
    engine_kwargs: dict | None = None,
    dataset: str = "random",
) -> dict:
    """One request at a time: TTFT (prefill + first token) and decode tokens/s, medians over iters.

    pagedllm's figures come from the request's own timestamps; transformers' from a 1-token run
    (TTFT) and a full run: decode rate = (output_len - 1) / (full - TTFT).
    """
    import statistics

    import torch

    from pagedllm.model_loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    prompt = (
        make_copy_prompt(tokenizer, input_len)
        if dataset == "copy"
        else make_w64(tokenizer, 1, input_len, input_len, 0)[0]
    )
    ttfts, decode_rates, outputs = [], [], []
    llm = None
    if backend == "pagedllm":
        from pagedllm import LLM, SamplingParams

        # every iteration pays its full prefill
        llm = LLM(model=model, enable_prefix_caching=False, **(engine_kwargs or {}))
        sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

        def once() -> tuple[float, float]:
            out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            outputs.append(out.outputs[0].token_ids)
            m = out.metrics
            assert m is not None and m.first_token_time is not None and m.last_token_time is not None  # finished
            return m.first_token_time - m.arrival_time, (output_len - 1) / (m.last_token_time - m.first_token_time)
    else:
        model_hf = _load_transformers(model)
        ids = torch.tensor([prompt])

        def once() -> tuple[float, float]:
            with torch.inference_mode():
                t0 = time.perf_counter()
                model_hf.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                model_hf.generate(
                    input_ids=ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
                )
                total = time.perf_counter() - t0
            return ttft, (output_len - 1) / max(total - ttft, 1e-9)

    from tqdm.auto import tqdm

    for i in tqdm(range(warmup + iters), desc=f"{backend} latency runs"):
        ttft, rate = once()
        if i >= warmup:
            ttfts.append(ttft)
            decode_rates.append(rate)
    result = {
        "median_ttft_ms": statistics.median(ttfts) * 1000,
        "median_decode_tok_s": statistics.median(decode_rates),
        "ttft_ms": [x * 1000 for x in ttfts],
        "decode_tok_s": decode_rates,
        "outputs": outputs[-1:],
    }
    if llm is not None:
        result["spec_decode"] = spec_report(llm)
    return result


def run_accuracy(model: str | None, engine_kwargs: dict, num_prompts: int, output_len: int) -> dict:
    """A quantized / low-precision-cache engine against float32 pagedllm on the same weights.

    greedy_agreement: of all output tokens, the fraction produced before each sequence's first
    divergence from the float32 run (a divergence ends the comparison: later tokens see other
    contexts). same_top_token: each engine reads every prompt followed by float32's greedy
    continuation, and this is the fraction of those continuation positions where both put the same
    token first (llama.cpp's "same top" statistic): how often a choice flips, with no divergence
    compounding it. perplexity: exp of the mean negative log-likelihood of TEXT's tokens (raw logprobs),
    scored in prefill chunks of 32 tokens so that each chunk reads the earlier ones' K/V back from
    the cache, as decoding does (a single-pass prefill would never see the cache's precision).
    """

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    prompts = [{"prompt_token_ids": p} for p in make_w64(tok, num_prompts, 32, 512, 1)]
    text = {"prompt_token_ids": tok.encode(TEXT, add_special_tokens=False)}
    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def evaluate(kwargs: dict, continuations: list[list[int]] | None) -> tuple[list[list[int]], float, list]:
        llm = LLM(model=model, enable_prefix_caching=False, max_num_batched_tokens=32, max_num_seqs=32, **kwargs)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=True)]
        ppl = perplexity(llm.generate([text], scoring, use_tqdm=False)[0].prompt_logprobs, text["prompt_token_ids"])
        tops = teacher_forced_tops(llm, [p["prompt_token_ids"] for p in prompts], continuations or outs)
        del llm
        gc.collect()
        return outs, ppl, tops

    # float32's function of the same weights: a GGUF's blocks with float32 activations (widening them all would
    # take 16x the file's memory for a K-quant), any other model's float weights
    exact = "gguf-exact" if resolve_model(model).kind == "gguf" else "none"
    ref_outs, ref_ppl, ref_tops = evaluate({"quantization": exact}, None)
    outs, ppl, tops = evaluate(engine_kwargs, ref_outs)
    return {
        "config": engine_kwargs,
        "num_prompts": num_prompts,
        "output_len": output_len,
        **greedy_agreement(ref_outs, outs),
        "same_top_token": same_top_token(ref_tops, tops),
        "perplexity": ppl,
        "perplexity_float32": ref_ppl,
        "perplexity_text_tokens": len(text["prompt_token_ids"]),
    }


def package_source() -> str:
    """This package's own Python source, file by file: real code for long prompts (about 190k tokens)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return "".join(f"# file: {f.relative_to(root.parent)}\n{f.read_text()}\n" for f in sorted(root.rglob("*.py")))


def run_context_accuracy(model: str | None, engine_kwargs: dict, reference_kv: str, lengths: list[int]) -> dict:
    """A KV cache dtype on long prompts: the engine against the same engine with a ``reference_kv`` cache.

    Each reads one prompt of code per length (this package's source) in its default prefill chunks, every later
    chunk reading the earlier ones' K/V back from the cache as a decode at that depth would, and scores every
    position. same_top_token: the fraction of the prompt's positions where both rank the same next token first;
    perplexity: of the prompt's own tokens, each engine's.
    """

    from pagedllm import LLM, SamplingParams
    from pagedllm.errors import InvalidParameterError
    from pagedllm.model_loader import load_tokenizer, resolve_model

    ids = load_tokenizer(resolve_model(model)).encode(package_source())
    if not lengths or min(lengths) < 2 or max(lengths) > len(ids):
        raise InvalidParameterError(f"context lengths must be 2 to {len(ids):,} tokens, got {lengths}", "lengths")
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1)

    def evaluate(kwargs: dict) -> dict[int, tuple[list[int], float, float]]:
        llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=1, max_model_len=max(lengths) + 1, **kwargs)
        from tqdm.auto import tqdm

        out = {}
        for n in tqdm(lengths, desc=f"kv_cache_dtype {kwargs['kv_cache_dtype']}: long prompts"):
            t0 = time.perf_counter()
            lps = llm.generate([{"prompt_token_ids": ids[:n]}], scoring, use_tqdm=False)[0].prompt_logprobs
            seconds = time.perf_counter() - t0
            assert lps is not None  # asked for by ``scoring``
            out[n] = ([first_ranked(e) for e in lps[1:] if e is not None], perplexity(lps, ids[:n]), seconds)
        del llm
        gc.collect()
        return out

    ref = evaluate({**engine_kwargs, "kv_cache_dtype": reference_kv})
    ours = evaluate(engine_kwargs)
    return {
        "config": engine_kwargs,
        "reference_kv_cache_dtype": reference_kv,
        "lengths": {
            n: {
                "same_top_token": same_top_token([ref[n][0]], [ours[n][0]]),
                "perplexity": ours[n][1],
                "perplexity_reference": ref[n][1],
                "prefill_s": ours[n][2],
                "prefill_s_reference": ref[n][2],
            }
            for n in lengths
        },
    }


def perplexity(prompt_logprobs, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of a prompt's tokens ids[1:], from its prompt_logprobs."""
    import math

    assert prompt_logprobs is not None  # asked for
    nll = 0.0
    for lp, t in zip(prompt_logprobs[1:], ids[1:]):
        assert lp is not None  # only the first position has none
        nll -= lp[t].logprob
    return math.exp(nll / (len(ids) - 1))


def first_ranked(entry: dict) -> int:
    """The token a position's logprobs rank first."""
    return next(t for t, lp in entry.items() if lp.rank == 1)


def teacher_forced_tops(llm, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The token LLM ranks first at each position of each continuation, reading prompt + continuation."""
    from pagedllm import SamplingParams

    forced = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
    outs = llm.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [[first_ranked(entry) for entry in o.prompt_logprobs[len(p) :]] for o, p in zip(outs, prompts)]


def same_top_token(ref_tops: list[list[int]], tops: list[list[int]]) -> float:
    """Fraction of positions where two engines' teacher_forced_tops agree."""
    pairs = [(a, b) for x, y in zip(ref_tops, tops) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def greedy_agreement(ref: list[list[int]], ours: list[list[int]]) -> dict:
    """Fraction of reference tokens matched before each sequence's first divergence, and whole matches."""
    agreed = identical = 0
    for a, b in zip(ref, ours):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed += n
        identical += a == b
    return {"greedy_agreement": agreed / max(sum(map(len, ref)), 1), "identical_sequences": f"{identical}/{len(ref)}"}


def _progress(bar):
    """A transformers stopping criterion that never stops: it advances ``bar`` once per decode step."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Progress(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            bar.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Progress()])


def _load_transformers(model_path: str | None):
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader import resolve_model

    src = resolve_model(model_path)
    logging.getLogger("pagedllm").info(
        "loading transformers' own model from %s (float32; this takes a while)", src.path
    )
    if src.kind == "gguf":
        m = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(src.path), gguf_file=os.path.basename(src.path), dtype=torch.float32
        )
    else:
        m = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
    return m.eval()


def add_parsers(sub) -> None:
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.cli_args import add_command

    model_help = "model path or cached repo id; default: the embedded SmolLM2"
    tp = add_command(sub, "throughput", help="offline throughput on the W64 workload, optionally vs transformers")
    tp.add_argument("--model", default=None, help=model_help)
    tp.add_argument(
        "--backend",
        choices=[
            "pagedllm",
            "transformers",
            "both",
            "spec-vs-off",
            "structured-vs-off",
            "parallel-vs-single",
            "lora-vs-base",
            "hybrid-vs-off",
        ],
        default="both",
        help="both: pagedllm and transformers side by side in this process, with their ratio; "
        "spec-vs-off: pagedllm with --speculative-config and without it; structured-vs-off: "
        "every request under --structured-outputs, and none; parallel-vs-single: pagedllm with "
        "--tensor/--pipeline-parallel-size and in one process; lora-vs-base: the prompts spread "
        "over --num-loras random adapters of --lora-rank, and the base model alone; "
        "hybrid-vs-off: a model with sliding-window layers (Gemma 3) freeing their blocks behind "
        "the window, and keeping them (disable_hybrid_kv_cache_manager), in the same KV memory",
    )
    tp.add_argument(
        "--kv-cache-memory", type=float, default=None, help="pagedllm's KV cache in GiB (CPU; default: the engine's 4)"
    )
    tp.add_argument("--num-loras", type=int, default=8, help="lora-vs-base: adapters (all active at once)")
    tp.add_argument("--lora-rank", type=int, default=16, help="lora-vs-base: their rank")
    tp.add_argument("--tensor-parallel-size", type=int, default=1, help="pagedllm's TP ranks")
    tp.add_argument("--pipeline-parallel-size", type=int, default=1, help="pagedllm's pipeline stages")
    tp.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=None,
        help="how pagedllm starts its workers (default: mp)",
    )
    tp.add_argument(
        "--structured-outputs",
        default=None,
        help='structured-vs-off: the constraint as JSON, e.g. \'{"json": {...}}\' or \'{"regex": "..."}\' '
        "(default: a schema of 20+ records)",
    )
    tp.add_argument(
        "--structured-outputs-config",
        default=None,
        help='the backend, as JSON: \'{"backend": "xgrammar" | "guidance"}\'',
    )
    tp.add_argument(
        "--dataset-name",
        default="random",
        choices=["random", "images"],
        help="random: prompts cut by token count from fixed English text at different offsets; images (a "
        "vision-language model): the same texts after 1 or 2 random-noise images of 32 to 480 pixels a side, in "
        "the checkpoint's chat template, against transformers' own class and processor",
    )
    tp.add_argument("--num-prompts", type=int, default=64, help="prompts in the workload")
    tp.add_argument("--input-len", type=int, default=None, help="fixed input length (overrides the range)")
    tp.add_argument("--min-input-len", type=int, default=32, help="shortest prompt, in tokens")
    tp.add_argument("--max-input-len", type=int, default=512, help="longest prompt, in tokens")
    tp.add_argument("--output-len", type=int, default=128, help="greedy tokens generated per prompt (EOS ignored)")
    tp.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths")
    tp.add_argument("--hf-batch-size", type=int, default=64, help="prompts per transformers generate() batch")
    tp.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="pagedllm's token budget per step; default: the engine's",
    )
    _add_quant_args(tp, "transformers always runs float32")
    tp.add_argument("--output-json", default=None, help="also write the JSON report here")
    tp.set_defaults(func=_cmd_throughput)

    lat = add_command(sub, "latency", help="single-request TTFT and decode speed, optionally vs transformers")
    lat.add_argument("--model", default=None, help=model_help)
    lat.add_argument(
        "--backend",
        choices=["pagedllm", "transformers", "both", "spec-vs-off"],
        default="both",
        help="both: pagedllm and transformers in this process, with their ratio; "
        "spec-vs-off: pagedllm with --speculative-config and without it",
    )
    lat.add_argument(
        "--dataset",
        choices=["random", "copy"],
        default="random",
        help="random: input-len tokens of fixed English text; copy: a chat prompt asking to repeat "
        "input-len tokens of it word for word (the answer quotes the prompt)",
    )
    lat.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    lat.add_argument("--output-len", type=int, default=128, help="greedy tokens generated (EOS ignored)")
    lat.add_argument("--num-iters", type=int, default=5, help="measured runs; the report gives medians")
    lat.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured runs first")
    lat.add_argument("--output-json", default=None, help="also write the JSON report here")
    _add_quant_args(lat, "transformers always runs float32")
    lat.set_defaults(func=_cmd_latency)

    acc = add_command(
        sub,
        "accuracy",
        help="greedy agreement, same top token and perplexity of --quantization / "
        "--kv-cache-dtype against float32 pagedllm on the same weights",
    )
    acc.add_argument("--model", default=None, help=model_help)
    acc.add_argument("--num-prompts", type=int, default=8, help="prompts whose greedy outputs are compared")
    acc.add_argument("--output-len", type=int, default=128, help="greedy tokens per prompt")
    _add_quant_args(acc, "compared with float32 pagedllm on the same weights")
    acc.add_argument(
        "--context-lengths",
        default=None,
        help="comma-separated prompt lengths in tokens: instead, score one prompt of code of each length against the "
        "same engine with --reference-kv-cache-dtype (same top token and perplexity at every position)",
    )
    acc.add_argument(
        "--reference-kv-cache-dtype",
        default="float32",
        choices=EngineConfig.choices("cache_config", "kv_cache_dtype"),
        help="the reference engine's KV cache dtype for --context-lengths",
    )
    acc.add_argument("--output-json", default=None, help="also write the JSON report here")
    acc.set_defaults(func=_cmd_accuracy)


def _add_quant_args(parser, reference: str) -> None:
    from pagedllm.config import EngineConfig

    quantizations = EngineConfig.choices("model_config", "quantization")
    assert quantizations is not None  # a Literal field
    parser.add_argument(
        "--quantization",
        choices=[c for c in quantizations if c is not None],
        default=None,
        help=f"pagedllm's weight-only quantization ({reference})",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=EngineConfig.choices("cache_config", "kv_cache_dtype"),
        help=f"pagedllm's KV cache dtype ({reference})",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help="pagedllm's speculative decoding, as JSON (see `pagedllm generate --help`)",
    )


def _quant_kwargs(args) -> dict:
    kwargs = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if args.speculative_config:
        kwargs["speculative_config"] = args.speculative_config
    return kwargs


def _variants(args) -> dict[str, tuple[str, dict]]:
    """name -> (backend, engine kwargs) of each engine a bench command runs."""
    kwargs = _quant_kwargs(args)
    if getattr(args, "structured_outputs_config", None):
        kwargs["structured_outputs_config"] = args.structured_outputs_config
    if args.backend == "structured-vs-off":
        return {"pagedllm_structured": ("pagedllm", kwargs), "pagedllm_unconstrained": ("pagedllm", kwargs)}
    parallel = {
        k: getattr(args, k)
        for k in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")
        if getattr(args, k, None)
    }
    if args.backend == "lora-vs-base":
        lora = {"enable_lora": True, "max_loras": args.num_loras, "max_lora_rank": args.lora_rank}
        return {"pagedllm_lora": ("pagedllm", {**kwargs, **lora}), "pagedllm_base": ("pagedllm", kwargs)}
    if args.backend == "parallel-vs-single":
        if parallel.get("tensor_parallel_size", 1) * parallel.get("pipeline_parallel_size", 1) == 1:
            raise SystemExit("--backend parallel-vs-single needs --tensor-parallel-size or --pipeline-parallel-size")
        return {"pagedllm_parallel": ("pagedllm", {**kwargs, **parallel}), "pagedllm_single": ("pagedllm", kwargs)}
    kwargs.update(parallel)
    if args.backend == "hybrid-vs-off":
        return {
            "pagedllm_hybrid": ("pagedllm", kwargs),
            "pagedllm_all_blocks": ("pagedllm", {**kwargs, "disable_hybrid_kv_cache_manager": True}),
        }
    if args.backend == "spec-vs-off":
        if not args.speculative_config:
            raise SystemExit("--backend spec-vs-off needs --speculative-config")
        return {
            "pagedllm_spec": ("pagedllm", kwargs),
            "pagedllm_no_spec": ("pagedllm", {k: v for k, v in kwargs.items() if k != "speculative_config"}),
        }
    names = ["pagedllm", "transformers"] if args.backend == "both" else [args.backend]
    return {name: (name, kwargs) for name in names}


def emit(results: dict, path: str | None) -> None:
    text = json.dumps(results, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def emit_part(results: dict, name: str, path: str | None) -> None:
    """One engine's results as soon as it is done: a line on stderr, and the report so far in ``path``, so
    an engine run after it that fails (or is killed) cannot take them with it. ``emit`` writes the whole
    report at the end."""
    part = {
        k: ({n: v for n, v in r.items() if n != "outputs"} if isinstance(r, dict) else r) for k, r in results.items()
    }
    print(f"{name}: {json.dumps(part[name])}", file=sys.stderr, flush=True)
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(part, indent=2))


def check_optional(args, command: str) -> None:
    """What the command's engines need beyond pagedllm's own dependencies, checked before anything loads."""
    from pagedllm.benchmarks.optional import require_any, require_transformers_for

    if any(backend == "transformers" for backend, _ in _variants(args).values()):
        what = "compares against transformers" if args.backend == "both" else "--backend transformers runs transformers"
        require_transformers_for(args.model, f"pagedllm bench {command} {what}")
    if args.backend == "structured-vs-off":
        require_any(
            f"pagedllm bench {command} --backend structured-vs-off constrains every request",
            ("xgrammar", "llguidance"),
            'pip install -e ".[structured]"',
        )


def _cmd_throughput(args) -> int:
    from pagedllm.model_loader import load_tokenizer, resolve_model

    check_optional(args, "throughput")
    lo, hi = (args.input_len, args.input_len) if args.input_len else (args.min_input_len, args.max_input_len)
    tok = load_tokenizer(resolve_model(args.model))
    prompts: list = make_w64(tok, args.num_prompts, lo, hi, args.seed)
    if args.dataset_name == "images":
        from pagedllm.benchmarks.images import make_image_prompts

        prompts = make_image_prompts(resolve_model(args.model).path, prompts, args.seed)
    n_prompt, n_out = sum(map(len, prompts)), args.num_prompts * args.output_len
    results: dict = {
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_tokens": n_prompt,
            "output_tokens": n_out,
            "input_len_range": [lo, hi],
        },
        "pagedllm_config": _quant_kwargs(args),
    }
    outputs = {}
    for name, (backend, kwargs) in _variants(args).items():
        if backend == "pagedllm":
            kwargs = {"model": args.model, **kwargs}
            if args.max_num_batched_tokens:
                kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
            if args.kv_cache_memory is not None:  # 0 or less: refused by the engine's config, not ignored
                kwargs["kv_cache_memory"] = int(args.kv_cache_memory * 2**30)
            structured = None
            if name == "pagedllm_structured":
                structured = json.loads(args.structured_outputs) if args.structured_outputs else {"json": BENCH_SCHEMA}
            loras = None
            if name == "pagedllm_lora":
                import tempfile

                root = tempfile.mkdtemp(prefix="pagedllm-bench-loras-")
                loras = make_random_adapters(args.model, args.num_loras, args.lora_rank, root)
            run = run_pagedllm(prompts, args.output_len, kwargs, structured, loras)
        elif args.dataset_name == "images":
            from pagedllm.benchmarks.images import run_transformers_images

            run = run_transformers_images(
                prompts, args.output_len, resolve_model(args.model).path, args.hf_batch_size, _progress
            )
        else:
            run = run_transformers(prompts, args.output_len, args.model, args.hf_batch_size)
        outputs[name] = run["outputs"]
        if args.dataset_name == "images":  # the text's tokens, and each image's placeholders, as processed
            n_prompt = run["prompt_tokens"]
            results["workload"]["prompt_tokens"] = n_prompt
            results["workload"]["images"] = sum(len(p["multi_modal_data"]["image"]) for p in prompts)
        results[name] = _rates(run["elapsed_s"], n_prompt, n_out, len(prompts))
        if run.get("spec_decode"):
            results[name]["spec_decode"] = run["spec_decode"]
        if run.get("structured_outputs"):
            results[name]["structured_outputs"] = run["structured_outputs"]
        if run.get("communication"):
            results[name]["communication"] = run["communication"]
        if "preemptions" in run:
            results[name]["preemptions"] = run["preemptions"]
        emit_part(results, name, args.output_json)
    if len(outputs) == 2:
        a, b = outputs
        results["ratio_total_tok_s"] = results[a]["total_tok_s"] / results[b]["total_tok_s"]
        if args.backend not in ("structured-vs-off", "lora-vs-base"):  # outputs differ by design
            key = {
                "transformers": "vs_transformers",
                "pagedllm_single": "parallel_vs_single",
                "pagedllm_all_blocks": "hybrid_vs_all_blocks",
            }.get(b, "spec_vs_no_spec")
            results[key] = greedy_agreement(outputs[b], outputs[a])
    results["peak_rss_mb_process"] = peak_rss_mb()
    emit(results, args.output_json)
    return 0


def _rates(elapsed: float, n_prompt: int, n_out: int, n_requests: int) -> dict:
    return {
        "elapsed_s": elapsed,
        "requests_s": n_requests / elapsed,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_prompt + n_out) / elapsed,
        "peak_rss_mb_so_far": peak_rss_mb(),
    }


def _cmd_accuracy(args) -> int:
    if args.context_lengths:
        lengths = [int(n) for n in args.context_lengths.split(",")]
        report = run_context_accuracy(args.model, _quant_kwargs(args), args.reference_kv_cache_dtype, lengths)
    elif args.reference_kv_cache_dtype != "float32":
        raise SystemExit("--reference-kv-cache-dtype goes with --context-lengths (otherwise float32 is the reference)")
    else:
        report = run_accuracy(args.model, _quant_kwargs(args), args.num_prompts, args.output_len)
    emit(report, args.output_json)
    return 0


def _cmd_latency(args) -> int:
    check_optional(args, "latency")
    results: dict = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dataset": args.dataset,
        "pagedllm_config": _quant_kwargs(args),
    }
    variants = _variants(args)
    for name, (backend, kwargs) in variants.items():
        results[name] = run_latency(
            args.model,
            args.input_len,
            args.output_len,
            args.num_iters,
            args.num_iters_warmup,
            backend,
            kwargs,
            args.dataset,
        )
        emit_part(results, name, args.output_json)
    if len(variants) == 2:
        a, b = variants
        results["ratio_decode_tok_s"] = results[a]["median_decode_tok_s"] / results[b]["median_decode_tok_s"]
    outs = [results[name].pop("outputs") for name in variants]
    if args.backend == "spec-vs-off":  # speculation must not change a single token
        results["identical_outputs"] = outs[0] == outs[1]
    emit(results, args.output_json)
    return 0
