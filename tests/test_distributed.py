"""Tensor and pipeline parallelism, really run: every engine here starts tp x pp worker processes (``mp``)
or Ray actors that talk over torch.distributed (gloo), and must give the single-process engine's greedy
tokens, with logprobs within 1e-4, under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import EngineDeadError, InvalidParameterError

from utils import check_greedy_close

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SYSTEM = (
    "You are a careful assistant. Answer briefly, check every step of your reasoning twice, and say "
    "so plainly when you do not know the answer to a question. "
)
QUESTIONS = [
    "What is two plus two?",
    "Name a colour of the sky.",
    "Count from one to five.",
    "Which planet is the largest?",
    "Spell the word cat.",
    "What do bees make?",
]
# a shared prefix (prefix caching), prompts longer than the step budget (chunked prefill), and more
# sequences than the cache holds at once (preemption)
ENGINE_KW = dict(
    max_model_len=96, num_gpu_blocks_override=10, max_num_batched_tokens=32, max_num_seqs=6, enable_prefix_caching=True
)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)


def _run(model: Path | str, **kw: Any) -> tuple[list[tuple[list[int], list[float]]], dict[str, int]]:
    llm = LLM(str(model), **{**ENGINE_KW, **kw})
    try:
        outs = llm.generate([SYSTEM + q for q in QUESTIONS], PARAMS, use_tqdm=False)
        s = llm.llm_engine.core.scheduler
        stats = {"preemptions": s.num_preemptions, "prefix_hits": s.kv.stats.hits}
        if s.connector is not None:
            stats["tier_hits"] = s.connector.stats.hits
        if llm.llm_engine.config.parallel_config.world_size > 1:  # read after the run: no step left in flight
            _check_communication(llm, llm.llm_engine.executor.collective_rpc("comm_stats"))
    finally:
        llm.llm_engine.shutdown()
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return got, stats


def _check_communication(llm: LLM, ranks: list[dict[str, int]]) -> None:
    """The bytes each rank moved per computed token are what the split implies: per layer two all-reduces
    of [H] floats (plus one for the embedding on the first stage), and [H] hidden + [H] residual floats
    from each stage to the next."""
    pc, cfg = llm.llm_engine.config.parallel_config, llm.llm_engine.hf_config
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    for rank, r in enumerate(ranks):
        stage = rank // pc.tensor_parallel_size
        assert r["tokens"] > 0
        first, last = stage == 0, stage == pc.pipeline_parallel_size - 1
        my_layers = layers // pc.pipeline_parallel_size
        reduces = (2 * my_layers + first) if pc.tensor_parallel_size > 1 else 0
        assert r["all_reduce"] == reduces * h * 4 * r["tokens"]
        assert r["send"] == (0 if last else 2 * h * 4 * r["tokens"])
        assert (r["gather"] > 0) == (last and pc.tensor_parallel_size > 1)


def _assert_same(ref: list, got: list) -> None:
    for i, ((ref_ids, ref_lp), (ids, lp)) in enumerate(zip(ref, got)):
        assert ids == ref_ids, f"prompt {i}: tokens differ from the single-process engine"
        assert max(abs(a - b) for a, b in zip(ref_lp, lp)) < 1e-4, f"prompt {i}: logprobs differ"


@pytest.fixture(scope="module")
def qwen2_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen2")  # 4 heads, 2 KV heads, q/k/v biases, untied head


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3")  # q/k norm, tied head (the vocab-parallel embedding is the head)


@pytest.fixture(scope="module")
def reference(qwen2_dir: Path, qwen3_dir: Path) -> dict[str, tuple[list, dict]]:
    return {"qwen2": _run(qwen2_dir), "qwen3": _run(qwen3_dir)}


def test_the_workload_preempts_and_hits_the_prefix_cache(reference) -> None:
    for name, (_, stats) in reference.items():
        assert stats["preemptions"] > 0, name
        assert stats["prefix_hits"] > 0, name


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_mp_parallel_engine_matches_single_process(tp: int, pp: int, name: str, reference, request) -> None:
    model = request.getfixturevalue(f"{name}_dir")
    got, stats = _run(model, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    _assert_same(reference[name][0], got)
    if pp == 1:
        assert stats == reference[name][1]  # the same scheduling: the scheduler never knows there are workers
    else:  # one micro-batch per stage schedules differently, and still preempts and hits the cache
        assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0


def test_kv_tiers_under_tensor_and_pipeline_parallelism(qwen2_dir: Path, reference, tmp_path: Path) -> None:
    """Each of the 4 ranks keeps its own shard in the RAM pool and on disk, at the same slots and names."""
    disk = {"kv_connector": "DiskConnector", "kv_connector_extra_config": {"path": str(tmp_path)}}
    got, stats = _run(
        qwen2_dir,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        kv_offloading_size=0.01,
        preemption_mode="swap",
        kv_transfer_config=disk,
    )
    _assert_same(reference["qwen2"][0], got)
    assert stats["preemptions"] > 0 and stats["tier_hits"] > 0
    files = [f.name for d in tmp_path.iterdir() for f in d.iterdir()]
    assert files and {f.rsplit(".r", 1)[1] for f in files} == {"0", "1", "2", "3"}
    assert len(files) % 4 == 0  # every block on every rank
    got, stats = _run(qwen2_dir, tensor_parallel_size=2, pipeline_parallel_size=2, kv_transfer_config=disk)
    _assert_same(reference["qwen2"][0], got)  # a restarted engine reads every rank's files back
    assert stats["tier_hits"] > 0


def test_tp2_ranks_hold_half_of_each_layer(qwen2_dir: Path) -> None:
    llm = LLM(str(qwen2_dir), **ENGINE_KW, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        infos = llm.llm_engine.executor.collective_rpc("shard_info")
    finally:
        llm.llm_engine.shutdown()
    assert [(i["tp_rank"], i["pp_rank"]) for i in infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [i["layers"] for i in infos] == [[0, 1], [0, 1], [1, 2], [1, 2]]
    assert all(i["num_heads"] == 2 and i["num_kv_heads"] == 1 and i["mlp_size"] == 64 for i in infos)
    assert [i["kv_head_start"] for i in infos] == [0, 1, 0, 1]
    assert [i["vocab_rows"] for i in infos] == [49152 // 2, 49152 // 2, None, None]  # untied: only stage 0 embeds
    assert len({i["pid"] for i in infos} | {os.getpid()}) == 5  # four worker processes


@pytest.mark.parametrize("quantization", ["none", "gguf-exact", "int4", "gguf"])
def test_tp3_smollm2_matches_single_process(quantization: str) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads over 3 ranks (one KV head each), from the embedded GGUF: float32
    (none) or as stored (gguf-exact, the default under TP; int4; gguf, the default in one process), where each
    rank cuts the file's Q4_1 blocks (rows, or whole groups of 32 columns). With float32 activations the ranks give
    the single process's tokens and logprobs to 1e-4."""
    kw = dict(max_model_len=96, num_gpu_blocks_override=16, max_num_batched_tokens=24, quantization=quantization)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    prompts = [SYSTEM + q for q in QUESTIONS[:3]]

    def run(**extra: Any) -> list:
        llm = LLM(**kw, **extra)
        try:
            return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()

    single, ranks = run(), run(tensor_parallel_size=3)
    if quantization != "gguf":
        _assert_same(*([(list(o.token_ids), _chosen(o)) for o in out] for out in (single, ranks)))
        return
    # gguf rounds activations to int8 per group of 32: the ranks' partial sums, added in another
    # order (and torch's own reductions with fewer threads a rank), can move a value across a rounding step,
    # which 30 layers carry on; so the logprob-aware comparison: where the greedy tokens part, each side's
    # token is in the other's top 5 and near its choice; a rank with a wrong slice of the blocks is far off
    check_greedy_close(
        single,
        ranks,
        topk=5,
        logprob_atol=0.25,
        min_exact_fraction=1 / 3,
        max_divergence_gap=0.25,
        names=("single process", "tp=3"),
    )


def _chosen(out: Any) -> list[float]:
    return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def test_a_killed_worker_fails_the_engine_fast(qwen2_dir: Path) -> None:
    llm = LLM(str(qwen2_dir), **ENGINE_KW, tensor_parallel_size=2)
    executor = llm.llm_engine.executor
    try:
        llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(executor.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker 1"):
            llm.generate([SYSTEM + q for q in QUESTIONS], PARAMS, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert all(p.poll() is not None for p in executor.procs)  # every other worker was stopped too
        assert executor.failure() is not None
    finally:
        llm.llm_engine.shutdown()


class _ReapedLate:
    """A worker process that was killed: its sockets are closed, but it can be reaped only after ``polls``."""

    def __init__(self, polls: int):
        self.polls, self.returncode = polls, None

    def poll(self) -> int | None:
        self.polls -= 1
        if self.polls < 0:
            self.returncode = -9
        return self.returncode


class _Alive:
    returncode = None

    def poll(self) -> None:
        return None


class _Exited:
    """A worker that exited by itself (code 0), as one does after reporting its error."""

    returncode = 0

    def poll(self) -> int:
        return 0


def test_a_peers_death_is_blamed_even_when_a_rank_reports_the_broken_collective_first() -> None:
    from multiprocessing import Pipe

    from pagedllm.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # its two ranks' pipes, without processes
    executor._dead, executor._started = None, True
    executor._stop_workers = lambda: None  # type: ignore[method-assign]
    (ours0, theirs0), (ours1, _theirs1) = Pipe(), Pipe()
    executor.conns, executor.procs = [ours0, ours1], [_Alive(), _ReapedLate(polls=5)]
    theirs0.send(("error", RuntimeError("Read error: Connection reset by peer"), "Traceback ..."))
    with pytest.raises(EngineDeadError, match=r"^worker 1 died \(exit code -9\); then worker 0 failed: "):
        executor._receive([0, 1])
    executor._dead = None  # a rank's own error, with every peer alive, is its own
    executor.procs = [_Alive(), _Alive()]
    theirs0.send(("error", ValueError("bad"), "Traceback ..."))
    with pytest.raises(EngineDeadError, match=r"^worker 0 failed: ValueError"):
        executor._receive([0, 1])
    # a peer that failed on its own and exited (code 0) after reporting it: its error is the cause, not a death
    executor._dead = None
    executor.procs = [_Alive(), _Exited()]
    theirs0.send(("error", RuntimeError("Connection reset by peer"), "Traceback ..."))
    _theirs1.send(("error", MemoryError("out of memory on rank 1"), "Traceback ..."))
    with pytest.raises(EngineDeadError) as failed:
        executor._receive([0, 1])
    message = str(failed.value)
    assert "worker 1 failed: MemoryError" in message and "worker 0 failed: RuntimeError" in message
    assert "died" not in message


def test_bad_parallel_sizes_are_refused_at_start(qwen2_dir: Path) -> None:
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size=3 does not divide the model's 4"):
        LLM(str(qwen2_dir), tensor_parallel_size=3)
    with pytest.raises(InvalidParameterError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        LLM(str(qwen2_dir), pipeline_parallel_size=3)
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(qwen2_dir), tensor_parallel_size=0)
    with pytest.raises(InvalidParameterError, match="pagedllm serve --data-parallel-size"):
        LLM(str(qwen2_dir), data_parallel_size=2)
    with pytest.raises(InvalidParameterError, match="uniproc"):
        LLM(str(qwen2_dir), tensor_parallel_size=2, distributed_executor_backend="uniproc")
    with pytest.raises(InvalidParameterError, match="only 'ngram'"):
        LLM(
            str(qwen2_dir),
            tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2},
        )


# -- Ray -----------------------------------------------------------------------------


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    # (the workers' own output stays in Ray's log files: forwarded here, it landed in the test output)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_ray_parallel_engine_matches_single_process(tp: int, pp: int, qwen3_dir: Path, reference, local_ray) -> None:
    got, stats = _run(qwen3_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray")
    _assert_same(reference["qwen3"][0], got)
    if pp == 1:
        assert stats == reference["qwen3"][1]


def test_ray_without_enough_cpus_says_what_it_asked_and_found(qwen2_dir: Path, local_ray) -> None:
    with pytest.raises(InvalidParameterError, match=r"need 8 CPU, one per worker, and the cluster has 4 CPU"):
        LLM(str(qwen2_dir), tensor_parallel_size=4, pipeline_parallel_size=2, distributed_executor_backend="ray")


def test_ray_pp2_spans_two_nodes(qwen2_dir: Path, reference) -> None:
    """Two simulated nodes of one CPU each: the placement group must put one stage on each."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        llm = LLM(str(qwen2_dir), **ENGINE_KW, pipeline_parallel_size=2, distributed_executor_backend="ray")
        try:
            nodes = [node_id for node_id, _, _ in llm.llm_engine.executor.nodes]
            outs = llm.generate([SYSTEM + q for q in QUESTIONS], PARAMS, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert len(set(nodes)) == 2
    assert [list(o.outputs[0].token_ids) for o in outs] == [ids for ids, _ in reference["qwen2"][0]]


def test_server_with_a_dead_worker_fails_fast_and_sigterm_stops_every_worker(qwen2_dir: Path) -> None:
    import subprocess

    import httpx

    from utils import MODEL, Server

    def workers(pid: int) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def gone(pid: int) -> bool:
        return not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text()

    healthy = Server(str(qwen2_dir), "--tensor-parallel-size", "2")
    pids = workers(healthy.proc.pid)
    assert len(pids) == 2
    assert healthy.stop() == 0
    assert all(gone(p) for p in pids)

    from pagedllm.model_loader import resolve_model

    # SmolLM2 in two pipeline stages: slow enough here that the stream is surely still running at the kill
    server = Server(resolve_model(None).path, "--pipeline-parallel-size", "2")
    try:
        body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
            stages = workers(server.proc.pid)
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data:"))  # it is generating
                os.kill(stages[1], signal.SIGKILL)
                rest = "\n".join(lines)
            assert '"type": "EngineDeadError"' in rest  # an error event ends the stream: no silent truncation
            # a pipeline stage lost cannot be rebuilt in-process: the server exits non-zero for its orchestrator to
            # restart it; until then /health says the engine is dead and a late request is refused at once
            try:
                health = client.get("/health")
                assert health.status_code == 503 and "engine_dead" in health.text, health.text
                t0 = time.monotonic()
                late = client.post("/v1/completions", json={**body, "max_tokens": 2})
                assert late.status_code == 503 and time.monotonic() - t0 < 5
            except httpx.TransportError:  # it has exited already (a fast machine)
                pass
        assert server.proc.wait(60) == 1
        assert all(gone(p) for p in stages)
    finally:
        server.stop()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_expert_parallel_matches_single_process(tiny_model_factory, name: str) -> None:
    """--enable-expert-parallel at tp=2: each rank holds 4 of the 8 experts whole (rank 0 the shared expert),
    attention and qwen3_moe's dense layer 0 split as usual; the same tokens as one process."""
    model = tiny_model_factory(name)
    ref, _ = _run(model)
    got, _ = _run(model, tensor_parallel_size=2, enable_expert_parallel=True)
    _assert_same(ref, got)


def test_tensor_parallel_moe_without_expert_parallel_is_refused(tiny_model_factory) -> None:
    with pytest.raises(InvalidParameterError, match="enable_expert_parallel"):
        LLM(str(tiny_model_factory("mixtral")), tensor_parallel_size=2)


def test_tp2_embeddings_served_equal_single_process(qwen2_dir: Path) -> None:
    """`pagedllm serve --runner pooling` on a decoder under tensor_parallel_size=2 (two worker processes):
    /v1/embeddings gives the single process's vectors, and the requests count in /metrics."""
    import httpx
    import torch

    from utils import MODEL, Server

    texts = [SYSTEM + q for q in QUESTIONS] + ["a"]
    llm = LLM(str(qwen2_dir), runner="pooling", max_model_len=96, max_num_seqs=4)
    try:
        ref = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
        prompt_tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts))
    finally:
        llm.llm_engine.shutdown()
    server = Server(
        str(qwen2_dir),
        "--runner",
        "pooling",
        "--max-model-len",
        "96",
        "--max-num-seqs",
        "4",
        "--tensor-parallel-size",
        "2",
    )
    try:
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": texts}, timeout=120)
        assert r.status_code == 200, r.text
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        assert r.json()["usage"]["prompt_tokens"] == prompt_tokens
        assert server.metric("pagedllm:prompt_tokens_total") == prompt_tokens
    finally:
        assert server.stop() == 0
    assert ref.shape == (len(texts), 64)
    assert float((ref - got).abs().max()) < 1e-5
