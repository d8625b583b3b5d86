"""KV tiers behind the prefix cache: the RAM offload tier, swap preemption and the disk tier.

Each is shown to leave greedy outputs unchanged and to do what it exists for, as a counted figure: prompt
tokens not recomputed (the model runner counts every token it computes).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import build_parser, engine_kwargs
from pagedllm.errors import InvalidParameterError

from utils import check_greedy_close

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _docs(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _ask(docs: list[list[int]], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": d + [rng.randrange(100, 40000) for _ in range(8)]} for d in docs]


def _run(llm: LLM, prompts: list[dict], params: SamplingParams = GREEDY) -> tuple[list, int]:
    """(outputs, tokens the model computed for them)."""
    runner = llm.llm_engine.core.runner
    before = runner.num_tokens_computed
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, runner.num_tokens_computed - before


def _clean(llm: LLM) -> None:
    s = llm.llm_engine.core.scheduler
    s.check_invariants()
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks
    assert not s.connector.has_pending() if s.connector is not None else True


def _same(ref: list, outs: list) -> None:
    check_greedy_close(
        [o.outputs[0] for o in ref], [o.outputs[0] for o in outs], topk=5, min_exact_fraction=0.9, names=("off", "on")
    )


def test_ram_tier_cuts_recomputed_prompt_tokens_of_a_second_pass_by_90_percent(tiny_model_factory):
    """The issue's workload: 32 distinct 1,500-token documents asked about twice, a primary cache that holds
    fewer than three of them."""
    docs = _docs(0, 32, 1500)
    first, second = _ask(docs, 1), _ask(docs, 2)
    model = str(tiny_model_factory("llama", max_position_embeddings=2048))
    kw = dict(model=model, max_model_len=2048, num_gpu_blocks_override=256, max_num_batched_tokens=4096)
    plain = LLM(**kw)
    ref1, _ = _run(plain, first)
    ref2, plain_second = _run(plain, second)
    assert plain.llm_engine.core.make_stats().prefix_cache.hits == 0  # the primary cache alone keeps nothing

    tiered = LLM(**kw, kv_offloading_size=0.25)  # 0.25 GiB: 16,384 blocks of this tiny model
    outs1, _ = _run(tiered, first)
    outs2, tiered_second = _run(tiered, second)
    _same(ref1 + ref2, outs1 + outs2)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in second)
    decode = len(second) * (GREEDY.max_tokens - 1)
    assert plain_second - decode == prompt_tokens  # every prompt token recomputed
    recomputed = tiered_second - decode
    assert recomputed <= 0.1 * prompt_tokens, (recomputed, prompt_tokens)
    stats = tiered.llm_engine.core.make_stats().kv_connector
    assert stats.hits >= 0.9 * prompt_tokens and stats.queries >= stats.hits
    assert stats.ram_bytes_loaded > 0 and stats.ram_bytes_saved > 0
    assert all(o.num_cached_tokens >= 1488 for o in outs2)  # usage reports the loaded tokens as cached
    _clean(tiered)


def test_a_full_ram_tier_drops_its_least_recently_used_blocks(model):
    docs = _docs(3, 6, 300)
    llm = LLM(model=model, max_model_len=512, num_gpu_blocks_override=40, kv_offloading_size=40 * 16384 / 2**30)
    conn = llm.llm_engine.core.scheduler.connector
    assert conn.num_slots == 40
    _run(llm, _ask(docs, 4))
    _clean(llm)
    assert len(conn._lru) == 40  # full, and still consistent
    # 6 documents of 19 full blocks: the primary cache keeps the last two, RAM the two evicted last
    _, computed = _run(llm, _ask(docs[:1], 5))
    assert computed == 308 + GREEDY.max_tokens - 1  # the oldest was dropped: all recomputed
    _, computed = _run(llm, _ask(docs[3:4], 5))
    assert computed == 308 - 288 + GREEDY.max_tokens - 1  # a recent one comes back from RAM
    _clean(llm)


@pytest.mark.parametrize("mode,kv", [("recompute", "auto"), ("swap", "auto"), ("swap", "int8")])
def test_preemption_with_the_ram_tier_keeps_outputs_and_swap_recomputes_nothing(model, mode, kv):
    """int8: a block's rows carry their scales, so the tier moves them as bytes like any other dtype's."""
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))]} for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    roomy = LLM(model=model, max_model_len=128, num_gpu_blocks_override=256, kv_cache_dtype=kv)
    ref, ref_computed = _run(roomy, prompts, params)
    tight = dict(model=model, max_model_len=128, num_gpu_blocks_override=12, kv_cache_dtype=kv)
    plain = LLM(**tight)
    _, plain_computed = _run(plain, prompts, params)
    llm = LLM(**tight, kv_offloading_size=0.01, preemption_mode=mode)
    outs, computed = _run(llm, prompts, params)
    _same(ref, outs)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert plain_computed > ref_computed  # without a tier, preemption recomputes
    if mode == "swap":  # the partial blocks come back too: exactly the tokens of an unpreempted run
        assert computed == ref_computed
        assert llm.llm_engine.core.make_stats().kv_connector.swapped_out > 0
    else:  # full blocks come back from RAM, the partial last block is recomputed
        assert ref_computed <= computed < plain_computed
    _clean(llm)


def _disk(path: Path, size_gb: float = 1) -> dict:
    return {
        "kv_connector": "DiskConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(path), "max_size_gb": size_gb},
    }


def test_disk_tier_survives_a_restart_and_refuses_corrupt_or_foreign_blocks(
    model, tiny_model_factory, tmp_path, caplog
):
    docs = _docs(11, 6, 300)
    prompts = _ask(docs, 12)
    kw = dict(model=model, max_model_len=512, num_gpu_blocks_override=64, kv_transfer_config=_disk(tmp_path))
    ref, ref_computed = _run(LLM(model=model, max_model_len=512, num_gpu_blocks_override=64), prompts)

    first = LLM(**kw)
    outs, computed = _run(first, prompts)
    _same(ref, outs)
    assert computed == ref_computed
    _clean(first)
    root = first.llm_engine.core.scheduler.connector.disk.root
    files = sorted(root.iterdir())
    assert len(files) == 6 * (308 // 16)  # every full block of every request, written through
    del first

    restarted = LLM(**kw)  # a new engine: only the directory carries over
    outs, restart_computed = _run(restarted, prompts)
    _same(ref, outs)
    # every full block but the one holding the last prompt token came from disk; then the decodes
    assert restart_computed == sum(
        len(p["prompt_token_ids"]) - 16 * ((len(p["prompt_token_ids"]) - 1) // 16) + GREEDY.max_tokens - 1
        for p in prompts
    )
    del restarted

    # a flipped byte in one block of each of the first three documents, and a well-formed file of another model
    doc_hashes = [restarted_hashes(o) for o in outs]
    for hashes in doc_hashes[:3]:
        f = root / f"{hashes[5].hex()}.r0"
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x40
        f.write_bytes(bytes(raw))
    other = LLM(
        model=str(tiny_model_factory("llama", seed=1)),
        max_model_len=512,
        num_gpu_blocks_override=64,
        kv_transfer_config=_disk(tmp_path),
    )
    _run(other, prompts[3:4])
    other_root = other.llm_engine.core.scheduler.connector.disk.root
    assert other_root != root  # another model's blocks live apart ...
    foreign = other_root / f"{doc_hashes[3][2].hex()}.r0"
    (root / foreign.name).write_bytes(foreign.read_bytes())  # ... and one copied in is refused too
    del other

    caplog.set_level(logging.WARNING, logger="pagedllm")
    checked = LLM(**kw)
    outs, computed = _run(checked, prompts)
    _same(ref, outs)
    refused = [r for r in caplog.records if "torn or not this model's" in r.getMessage()]
    assert len(refused) == 4
    # documents 0-2 recompute from their bad block (5 of 19 good), document 3 from block 2, the others nothing
    assert computed == restart_computed + 16 * (3 * 14 + 17)
    _clean(checked)


def restarted_hashes(out) -> list[bytes]:
    """The chained block hashes of an output's prompt, as the engine computes them."""
    from pagedllm.core.block_pool import hash_block_tokens

    ids, hashes = out.prompt_token_ids, []
    for i in range(len(ids) // 16):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, ids[16 * i : 16 * (i + 1)]))
    return hashes


def test_a_full_disk_skips_saving_and_fails_no_request(model, tmp_path, monkeypatch):
    from pagedllm.kv_transfer import disk

    def full(self, data):
        raise OSError(28, "No space left on device")

    kw = dict(model=model, max_model_len=256, num_gpu_blocks_override=16)  # room for two prompts: no reuse
    llm = LLM(**kw, kv_transfer_config=_disk(tmp_path))
    prompts = _ask(_docs(21, 3, 100), 22)
    ref, _ = _run(LLM(**kw), prompts)
    monkeypatch.setattr(disk.Path, "write_bytes", full)
    outs, _ = _run(llm, prompts)
    _same(ref, outs)
    outs, _ = _run(llm, prompts)  # nothing was saved: a lookup finds no file and recomputes
    _same(ref, outs)
    assert llm.llm_engine.core.make_stats().kv_connector.hits == 0
    _clean(llm)
    assert not any(llm.llm_engine.core.scheduler.connector.disk.root.iterdir())


def test_disk_tier_bound_deletes_the_oldest_blocks(model, tmp_path):
    llm = LLM(
        model=model,
        max_model_len=512,
        num_gpu_blocks_override=64,
        kv_transfer_config=_disk(tmp_path, size_gb=30 * 16384 / 2**30),
    )
    _run(llm, _ask(_docs(31, 4, 200), 32))
    _clean(llm)
    disk = llm.llm_engine.core.scheduler.connector.disk
    assert disk.max_blocks == 30 and len(disk.lru) == 30
    assert len(list(disk.root.iterdir())) == 30


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(kv_offloading_size=0), "kv_offloading_size"),
        (dict(kv_offloading_size=1, enable_prefix_caching=False), "kv_offloading_size"),
        (dict(preemption_mode="swap"), "preemption_mode"),
        (dict(kv_transfer_config={"kv_connector": "NoSuchConnector"}), "kv_transfer_config.kv_connector"),
        (
            dict(kv_transfer_config={"kv_connector": "DiskConnector"}),
            "kv_transfer_config.kv_connector_extra_config.path",
        ),
        (
            dict(
                kv_transfer_config={
                    "kv_connector": "DiskConnector",
                    "kv_role": "kv_sideways",
                    "kv_connector_extra_config": {"path": "/tmp/x"},
                }
            ),
            "kv_transfer_config.kv_role",
        ),
        (
            dict(
                kv_transfer_config={
                    "kv_connector": "DiskConnector",
                    "kv_connector_extra_config": {"path": "/tmp/x", "size": 3},
                }
            ),
            "kv_transfer_config.kv_connector_extra_config.size",
        ),
        (dict(kv_transfer_config='{"kv_connector": '), "kv_transfer_config"),
    ],
)
def test_bad_tier_settings_get_a_clear_error(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        LLM(model="unused", **kwargs)
    assert e.value.param == param


def test_cli_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        [
            "serve",
            "--kv-offloading-size",
            "8",
            "--kv-offloading-backend",
            "native",
            "--preemption-mode",
            "swap",
            "--kv-transfer-config",
            '{"kv_connector": "DiskConnector", "kv_connector_extra_config": {"path": "/var/cache/pagedllm-kv"}}',
        ]
    )
    kw = engine_kwargs(args)
    assert kw["kv_offloading_size"] == 8.0 and kw["preemption_mode"] == "swap"
    assert kw["kv_transfer_config"]["kv_connector"] == "DiskConnector"


def test_smollm2_through_every_tier_gives_the_same_tokens(tmp_path):
    """The embedded model with a 40-block primary cache (3 of these prompts fit, not their outputs):
    preempted requests swap,
    evicted blocks go to RAM, and a restarted engine reads the disk; the tokens never change."""
    rng = random.Random(41)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(200)]} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    kw = dict(kv_cache_memory=40 * 16 * 2 * 30 * 3 * 64 * 4, max_model_len=512)
    ref, ref_computed = _run(LLM(**kw), prompts, params)
    tiers = dict(kv_offloading_size=0.05, preemption_mode="swap", kv_transfer_config=_disk(tmp_path))
    first = LLM(**kw, **tiers)
    outs, computed = _run(first, prompts, params)
    _same(ref, outs)
    assert first.llm_engine.core.scheduler.num_preemptions > 0
    assert computed <= ref_computed
    _clean(first)
    del first
    outs, computed = _run(LLM(**kw, **tiers), prompts, params)  # restarted: the prompts come from disk
    _same(ref, outs)
    assert computed < ref_computed / 4


def test_a_block_deleted_between_its_check_and_its_load_is_recomputed(model, tmp_path, monkeypatch):
    """Another engine sharing the directory may delete a file after this scheduler checked it: the worker
    reports the block, the requests that read it lose that step and are recomputed, and nothing computed
    from it stays in the prefix cache."""
    from pagedllm.kv_transfer.offload import OffloadScheduler

    prompts = _ask(_docs(51, 3, 200), 52)
    kw = dict(model=model, max_model_len=512, num_gpu_blocks_override=64, kv_transfer_config=_disk(tmp_path))
    ref, _ = _run(LLM(model=model, max_model_len=512, num_gpu_blocks_override=64), prompts)
    _run(LLM(**kw), prompts)  # writes every block
    build = OffloadScheduler.build_connector_meta
    deleted = []

    def racing(self):
        meta = build(self)
        if meta is not None and meta.disk_loads and not deleted:
            h = meta.disk_loads[3][0]
            (self.disk.root / f"{h.hex()}.r0").unlink()
            deleted.append(h)
        return meta

    monkeypatch.setattr(OffloadScheduler, "build_connector_meta", racing)
    llm = LLM(**kw)
    outs, _ = _run(llm, prompts)
    _same(ref, outs)
    assert deleted and llm.llm_engine.core.scheduler.num_preemptions >= 1
    disk = llm.llm_engine.core.scheduler.connector.disk
    assert (disk.root / f"{deleted[0].hex()}.r0").exists()  # recomputed, and written again
    _clean(llm)


def test_smollm2_prefilled_by_a_producer_engine_decodes_to_the_same_tokens(tmp_path):
    """P/D without the HTTP legs (tests/test_disagg.py has them): a kv_producer engine computes each prompt
    with one token, a kv_consumer engine sharing its directory loads the blocks and decodes."""
    rng = random.Random(61)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(300)]} for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    kw = dict(max_model_len=512)

    def tier(role):
        return {**_disk(tmp_path), "kv_role": role}

    ref, ref_computed = _run(LLM(**kw), prompts, params)
    _run(LLM(**kw, kv_transfer_config=tier("kv_producer")), prompts, SamplingParams(temperature=0, max_tokens=1))
    consumer = LLM(**kw, kv_transfer_config=tier("kv_consumer"))
    outs, computed = _run(consumer, prompts, params)
    _same(ref, outs)
    assert computed == ref_computed - 3 * 288  # each prompt's 18 full blocks came from the producer
