"""Session-scoped fixtures: SmolLM2's tokenizer, tiny random-weight models, the transformers GGUF oracle.

The tiny models are real transformers checkpoints (config + float32 safetensors
+ SmolLM2's tokenizer) with random weights, one per architecture family the
engine claims to run. Each exercises the feature that family adds:

==============  =====================================================  ========
name            what it covers                                         tied
==============  =====================================================  ========
llama           GQA, head_dim (32) != hidden / heads (16)              no
llama3_rope     llama3 rope scaling over positions 0..~200             yes
qwen2           nonzero q/k/v biases                                   no
qwen3           q/k RMSNorm with non-trivial weights                   yes
mistral         sliding_window=32, shorter than most test prompts      no
==============  =====================================================  ========

Weights are drawn with ``initializer_range=0.2`` (not 0.02) so the logits are far
from uniform and greedy decoding has clear winners to compare.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from housekeeping import RAY_PREFIX, Progress, docs_tmp_paths, home_snapshot, remove_leftovers, write_mark
from utils import TINY_MODEL_NAMES, build_tiny_model, real_models_module

# Where the suite may write: HOME, the XDG folders and Ray's temp dir point into this session's pytest
# tmp (set before collection, so libraries that read them at import time see them too, and inherited by
# every server the tests start). Nothing lands in the user's ~/.cache, ~/.ray or /tmp/ray.
_ISOLATED = (
    "HOME",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "RAY_TMPDIR",
    "PAGEDLLM_CACHE_DIR",
)


# /tmp held at most 2.2 GB in a whole run with two workers, sampled every 5 s (2026-11-28): the suite's
# temp folders and the examples' /tmp/pagedllm-* paths
_DISK_NEEDED = int(2.5 * 2**30)
_ROOT = Path(__file__).resolve().parent.parent
_HOME_BEFORE = pytest.StashKey[tuple[Path, set[str]]]()
_SHARED_CACHE = pytest.StashKey[Path]()


@pytest.hookimpl(trylast=True)  # after pytest's tmpdir plugin has made the session's temp-path factory
def pytest_configure(config: pytest.Config) -> None:
    factory = config._tmp_path_factory  # type: ignore[attr-defined]
    # the real models the test command fetched (benchmarks/real_models.py) are read where they are, never written
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ.setdefault("PAGEDLLM_MODELS_DIR", os.path.join(cache, "pagedllm", "models"))
    base = factory.getbasetemp()
    controller = not hasattr(config, "workerinput")  # (an xdist worker has a folder in the controller's)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if controller:
        real_home = Path(os.path.expanduser("~"))
        config.stash[_HOME_BEFORE] = (real_home, home_snapshot(real_home))
        runs = base.parent if base.parent.name.startswith("pytest-of-") else None  # (not under --basetemp)
        docs = docs_tmp_paths(_ROOT)
        gone = remove_leftovers(runs, Path(tempfile.gettempdir()), base, docs)
        if gone and reporter is not None:
            reporter.write_line(f"removed what runs stopped partway left: {', '.join(map(str, gone))}")
        write_mark(base, tmp_before=sorted(str(p) for p in docs if os.path.lexists(p)))
        if reporter is not None:
            threaded = config.pluginmanager.has_plugin("dsession")  # xdist's controller: it runs no test itself
            config.pluginmanager.register(Progress(config, reporter, threaded), "pagedllm-progress")
    free = shutil.disk_usage(base).free
    if controller and free < _DISK_NEEDED:  # said once, by the controller
        pytest.exit(
            f"{free / 2**30:.1f} GiB free under {base.parent}: the suite writes up to about "
            f"{_DISK_NEEDED / 2**30:.1f} GiB there (tiny models, vision checkpoints, mypy's cache); free some space "
            "or point TMPDIR elsewhere",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    home = factory.mktemp("isolated", numbered=False) / "home"
    # pagedllm's own cache (kernels compiled per level, converted configs and tokenizers) is one for the whole run,
    # in the controller's folder (handed to each xdist worker: pytest_configure_node), so the workers compile each
    # level once between them, not once each (it is made for sharing: entries appear atomically and a kernel build
    # holds a lock that other processes wait on)
    worker_input: dict[str, Any] = getattr(config, "workerinput", {})
    shared = Path(worker_input["pagedllm_cache"]) if not controller else base / "shared-cache"
    config.stash[_SHARED_CACHE] = shared
    # Ray puts its sockets 70 bytes below its temp dir (ray/session_<date>_<pid>/sockets/plasma_store), and an
    # AF_UNIX path may not pass 107 bytes: the session's base folder itself, where it is short enough
    ray = base / "r"
    if len(str(ray)) > 36:
        ray = Path(tempfile.mkdtemp(prefix=RAY_PREFIX))
        write_mark(ray)  # (a run that is killed leaves it: the next one removes it)
        config.add_cleanup(lambda: shutil.rmtree(ray, ignore_errors=True))
    dirs = {
        "HOME": home,
        "XDG_CACHE_HOME": home / ".cache",
        "XDG_CONFIG_HOME": home / ".config",
        "XDG_DATA_HOME": home / ".local" / "share",
        "XDG_STATE_HOME": home / ".local" / "state",
        "RAY_TMPDIR": ray,
        "PAGEDLLM_CACHE_DIR": shared / "pagedllm",
    }
    assert set(dirs) == set(_ISOLATED)
    for name, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(path)
    os.environ.setdefault("RAY_worker_niceness", "0")  # the Ray clusters tests start, as the executor's own
    # Ray turns token authentication on for a cluster it starts and saves a new token in ~/.ray/auth_token (the
    # isolated home's, here): one token for the whole run, in the environment, and Ray writes no file for it
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(pytest-xdist, in the controller) each worker gets the controller's pagedllm cache folder."""
    node.workerinput["pagedllm_cache"] = str(node.config.stash[_SHARED_CACHE])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The run fails if it wrote under the user's home (what conftest's isolation should have sent elsewhere)."""
    if _HOME_BEFORE not in session.config.stash:  # (an xdist worker: the controller checks once, at the end)
        return
    home, before = session.config.stash[_HOME_BEFORE]
    new = sorted(home_snapshot(home) - before)
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the run wrote under {home} (or something beside it did): {', '.join(new)}", red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Under pytest-xdist (the README's test command runs two workers: on two cores a lone worker leaves them idle
# about half the time, waiting on servers that start, subprocesses that import and sockets), a test module is
# one unit of work, so its module-scoped engines and servers are built once. Every module that starts a Ray
# cluster is in one unit, so two clusters never start side by side. The units that take a minute or more go
# first, longest first, so the two workers end together rather than one running the soak alone at the end.
# (xdist's own `--dist loadgroup` cannot do this on pytest 9.2: it marks a group by rewriting the node id,
# which pytest 9.2 no longer reads; pytest-dev/pytest-xdist#1386.)
_RAY_MODULES = ("test_distributed", "test_serve_ray")
_LONGEST_FIRST = (
    "test_docs_examples",
    "ray",
    "test_soak",
    "test_gemma3",
    "test_spec_decode",
    "test_server",
    "test_vision",
    "test_spec_heads",
    "test_router",
    "test_qwen2_vl",
    "test_code_health",
    "test_hostile_requests",
    "test_real_model",
    "test_fidelity",
)


def _unit(nodeid: str) -> str:
    """The unit of work of a test: its module, or "ray" for every module that starts a Ray cluster."""
    module = Path(nodeid.split("::")[0]).stem
    return "ray" if module in _RAY_MODULES else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # the units go out in the order the workers collected them
    return ByUnit(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the longest units first (stable: a module keeps its order)
        rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))


@pytest.fixture(scope="module")
def module_tmp(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], Path]]:
    """``mktemp(name) -> Path`` for a module's fixtures, removed when the module's tests end unless one failed.

    pytest (``tmp_path_retention_policy = "failed"``) removes a passing test's ``tmp_path`` at once and the
    whole base folder after a green run, but keeps a session fixture's folder to the end; a module's models
    (hundreds of MB for the vision ones) would pile up over the run, where the machine's disk may be small."""
    made: list[Path] = []
    failed = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding SmolLM2's tokenizer (from the embedded GGUF), saved with ``save_pretrained``; or the
    saved copy that $PAGEDLLM_TEST_TOKENIZER_DIR names, on a machine without the embedded model (a GPU
    machine that the repository is copied to: docs/development.md)."""
    from pagedllm.model_loader import load_tokenizer, resolve_model

    if os.environ.get("PAGEDLLM_TEST_TOKENIZER_DIR"):
        given = Path(os.environ["PAGEDLLM_TEST_TOKENIZER_DIR"])
        assert (given / "tokenizer_config.json").is_file(), f"PAGEDLLM_TEST_TOKENIZER_DIR={given}: no saved tokenizer"
        return given
    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Callable[..., Path]:
    """``make(name, **config_overrides) -> Path``: a tiny model dir, built once per session per arguments."""
    built: dict[tuple, Path] = {}

    def make(name: str, **config_overrides: Any) -> Path:
        key = (name, tuple(sorted((k, repr(v)) for k, v in config_overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            built[key] = build_tiny_model(path, name, smollm2_tokenizer_dir, **config_overrides)
        return built[key]

    return make


@pytest.fixture(scope="session", params=TINY_MODEL_NAMES)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """Every tiny model in turn: a test using this fixture runs once per name in TINY_MODEL_NAMES."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def smollm2_hf_model() -> Any:
    """transformers' own model from the embedded SmolLM2 GGUF, in float32 (slow to load: ~30 s)."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_text_model() -> Any:
    """SmolLM2 as transformers' class with the same weights as ``smollm2_hf_model``, built in a few seconds
    (``benchmarks/vision_models.py``'s builder: pagedllm's reader, checked against transformers' own load in
    test_model_loader.py): for tests that need the weights in that form, not transformers' load as a reference."""
    from utils import benchmark_module

    return benchmark_module("vision_models").smollm2_text_model()


@pytest.fixture(scope="session")
def qwen_0_5b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF: the file the test command fetched (found through PAGEDLLM_MODELS_DIR),
    checked by sha256, or a fresh fetch into this session's temp folder."""
    rm = real_models_module()
    model = rm.get_model(rm.REFERENCE_MODEL)
    fetched = Path(os.environ.get("PAGEDLLM_MODELS_DIR", "/nonexistent")) / model.file
    if fetched.exists():
        rm.verify(fetched, model.sha256, model.size)
        return fetched
    return rm.fetch(rm.REFERENCE_MODEL, dest=tmp_path_factory.mktemp("models"))
