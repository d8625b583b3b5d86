"""Instruction-set levels (pagedllm.kernels.isa): what each CPU runs, $PAGEDLLM_CPU_LEVEL's choice, and the kernels
built at a level below the machine's own, which hold no instruction above it and give the same results."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pagedllm.kernels import isa

# AMD Zen 2 / 3, Intel Haswell to Comet Lake: x86-64-v3
AVX2 = frozenset(
    "fpu sse2 pni ssse3 cx16 sse4_1 sse4_2 movbe popcnt xsave lahf_lm abm avx avx2 fma f16c bmi1 bmi2".split()
)
CPUS = {
    "without AVX2": (frozenset("fpu sse2 sse4_2 avx".split()), ("portable",)),
    # AVX2 without MOVBE, which -march=x86-64-v3 may emit (some virtual CPUs hide it): not the avx2 level
    "AVX2 but no MOVBE": (AVX2 - {"movbe"}, ("portable",)),
    "AVX2": (AVX2, ("portable", "avx2")),
    "AVX2 + AVX-VNNI": (AVX2 | {"avx_vnni"}, ("portable", "avx2", "avx2-vnni")),
    # Skylake-SP: AVX-512 without VNNI: its int8 panels need VNNI, so the level is AVX2's
    "AVX-512 without VNNI": (AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}, ("portable", "avx2")),
    "AVX-512 VNNI": (  # Cascade Lake, Ice Lake
        AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"},
        ("portable", "avx2", "avx512-vnni"),
    ),
    "AVX-512 VNNI + BF16": (  # Zen 4, Sapphire Rapids
        AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"},
        ("portable", "avx2", "avx512-vnni", "avx512-bf16"),
    ),
}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_cpu_runs_the_levels_its_features_allow(cpu):
    flags, levels = CPUS[cpu]
    assert isa.machine_levels(flags) == levels


def test_the_environment_variable_chooses_a_level_at_or_below_the_machines(monkeypatch):
    flags = CPUS["AVX2"][0]
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.chosen_level(flags) == ("avx2", "the best this CPU and OS run")
    monkeypatch.setenv(isa.ENV, "portable")
    assert isa.chosen_level(flags) == ("portable", "$PAGEDLLM_CPU_LEVEL")
    monkeypatch.setenv(isa.ENV, "avx512-vnni")
    with pytest.raises(isa.CPULevelError, match=r"'avx512-vnni' needs what this machine lacks \(avx512_vnni, avx512bw"):
        isa.chosen_level(flags)
    # a level below the best that this CPU still lacks: Zen 4 runs avx512-vnni without AVX-VNNI
    zen4 = CPUS["AVX-512 VNNI"][0]
    monkeypatch.setenv(isa.ENV, "avx2-vnni")
    with pytest.raises(isa.CPULevelError, match=r"lacks \(avx_vnni\); its levels: portable, avx2, avx512-vnni"):
        isa.chosen_level(zen4)
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(isa.CPULevelError, match="portable, avx2, avx2-vnni, avx512-vnni, avx512-bf16, amx, native"):
        isa.chosen_level(flags)


def _built_at(level: str):
    """The whole kernel library built at ``level`` (in the kernel cache, as any build; the machine's own stays
    loaded)."""
    from pagedllm import kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(isa.ENV, level)
        built = kernels.load.__wrapped__()
    assert built.level == level
    return built


@pytest.fixture(scope="module")
def avx2_kernels():
    if "avx2" not in isa.machine_levels():
        pytest.skip("this machine does not run AVX2")
    built = _built_at("avx2")
    return built, Path(built.path)


def test_kernels_built_at_a_lower_level_hold_none_of_the_higher_ones_and_agree(avx2_kernels):
    from pagedllm import kernels
    from pagedllm.layers.quantization import quantize_int8

    built, so = avx2_kernels
    # the GGUF panels on 256-bit registers; the GEMM on the file's layout is AVX-512 VNNI's
    assert built.level == "avx2" and built.gguf.has_panels and not built.gguf.has_gemm
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert "ymm" in code and "zmm" not in code  # AVX2's 256-bit registers, never AVX-512's
    x, w = torch.randn(3, 256), torch.randn(16, 256)
    torch.testing.assert_close(
        built.int8_matmul(x, *quantize_int8(w)), kernels.load().int8_matmul(x, *quantize_int8(w)), rtol=1e-5, atol=1e-4
    )


def test_the_avx512_vnni_build_holds_no_bfloat16_products(tmp_path):
    """avx512-bf16 adds vdpbf16ps (attention over a bfloat16 cache); the level below never emits it."""
    from pagedllm import kernels
    from pagedllm.kernels.build import library_flags

    if "avx512-vnni" not in isa.machine_levels() or not shutil.which("objdump"):
        pytest.skip("needs AVX-512 VNNI and objdump")
    for level, has in (("avx512-vnni", False), ("avx512-bf16", True)):
        if level in isa.machine_levels():  # the build the kernel tests at this level load too
            code_file = _built_at(level).path
        else:  # compiled only
            code_file = str(tmp_path / f"{level}.o")
            src = Path(kernels.__file__).parent / "paged_attention.c"
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, *library_flags(level), "-c", str(src), "-o", code_file], check=True)
        code = subprocess.run(["objdump", "-d", code_file], capture_output=True, text=True, check=True).stdout
        assert ("vdpbf16ps" in code) == has, level


def test_only_the_amx_build_holds_tile_multiplies(tmp_path):
    """The amx level's GGUF kernels configure tiles, multiply on them (tdpbssd) and let them go; the level below
    never emits a tile instruction (the compiler is not allowed to: no -mamx-* flag). The machine's build where it
    runs amx, else compiled only, so it holds on any x86-64 machine."""
    from pagedllm import kernels
    from pagedllm.kernels.build import library_flags

    if not isa.is_x86() or not shutil.which("objdump"):
        pytest.skip("needs x86-64 and objdump")
    if "amx" in isa.machine_levels():  # the machine's own build
        code_file = _built_at("amx").path
    else:  # compiled only, at -O0: the same instructions chosen, in half the time
        code_file = str(tmp_path / "amx.o")
        src = Path(kernels.__file__).parent / "gguf_blocks.c"
        flags = [f for f in library_flags("amx") if f != "-O3"]
        subprocess.run([os.environ.get("CC", "cc"), *flags, "-O0", "-c", str(src), "-o", code_file], check=True)
    code = subprocess.run(["objdump", "-d", code_file], capture_output=True, text=True, check=True).stdout
    for instruction in ("ldtilecfg", "tileloadd", "tdpbssd", "tilestored", "tilerelease"):
        assert instruction in code, instruction
    assert "-mamx-int8" not in library_flags("avx512-bf16") and "-mamx-int8" in library_flags("amx")


def test_the_gguf_default_follows_the_kernel_level(avx2_kernels, qwen_0_5b, monkeypatch, caplog):
    """Qwen2.5-Coder-0.5B's tensors fit the panels: `gguf` where the kernels have them (AVX2 and up), `gguf-exact`
    below (the portable level, gguf_blocks.c built for it); the log names the level."""
    import logging

    from pagedllm import kernels
    from pagedllm.model_loader.resolve import resolve_model
    from pagedllm.worker.loader import resolve_quantization

    portable = _built_at("portable")  # (the build the kernel tests at the portable level load too)
    assert not portable.gguf.has_panels and not portable.gguf.has_gemm
    source = resolve_model(str(qwen_0_5b))
    cpu = torch.device("cpu")
    native = kernels.load()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert resolve_quantization(None, source, None, cpu) == ("gguf" if native.gguf.has_panels else "gguf-exact")
        monkeypatch.setattr(kernels, "try_load", lambda: avx2_kernels[0])
        assert resolve_quantization(None, source, None, cpu) == "gguf"
        monkeypatch.setattr(kernels, "try_load", lambda: portable)
        assert resolve_quantization(None, source, None, cpu) == "gguf-exact"
    assert f"at the {native.level} kernel level" in caplog.text and "gguf: the default" in caplog.text
    assert "at the avx2 kernel level" in caplog.text
    assert "quantization gguf-exact: the default for" in caplog.text and "at the portable kernel level" in caplog.text


def test_an_engine_asked_for_a_level_that_is_not_one_fails_at_once(monkeypatch, tiny_model_factory):
    """Before anything loads, with the variable named (not on the kernels' build thread, nor by falling back)."""
    from pagedllm import LLM

    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(isa.CPULevelError, match=r"\$PAGEDLLM_CPU_LEVEL='sse9' is not a level"):
        LLM(str(tiny_model_factory("llama")))


class FakePrctl:
    """arch_prctl as a VM's kernel answers it: the extended features it supports (ARCH_GET_XCOMP_SUPP writes the
    mask), and whether it grants tile data (ARCH_REQ_XCOMP_PERM)."""

    def __init__(self, supported: int, grants: bool):
        self.supported, self.grants, self.asked = supported, grants, []

    def __call__(self, code: int, arg: int) -> tuple[int, int]:
        self.asked.append(code)
        if code == isa._ARCH_GET_XCOMP_SUPP:
            ctypes.c_ulong.from_address(arg).value = self.supported
            return 0, 0
        return (0, 0) if self.grants else (-1, 1)  # EPERM


SAPPHIRE_RAPIDS = CPUS["AVX-512 VNNI"][0] | {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"}
TILES = 1 << 17 | 1 << 18  # XTILECFG, XTILEDATA


def test_amx_is_used_only_where_the_os_grants_tile_data(monkeypatch):
    """A CPU that lists AMX is asked, as AMX code must ask, whether this process may use tiles: a VM that lists
    amx_tile but supports no tile state, or refuses the permission, gets 'not used' with the reason, and the amx
    level is not among its levels (the best of the rest runs; asked for by name, it is refused with the reason);
    where the OS grants tile data, amx is the best level, and the log says what AMX does there."""
    refused = FakePrctl(0xE7 | TILES, grants=False)
    granted, why = isa.amx_status(SAPPHIRE_RAPIDS, refused)
    assert not granted and "refuses this process tile data" in why and "Operation not permitted" in why
    assert refused.asked == [isa._ARCH_GET_XCOMP_SUPP, isa._ARCH_REQ_XCOMP_PERM]
    assert isa.amx_note("avx512-bf16", SAPPHIRE_RAPIDS, refused).endswith("; not used")
    assert isa.machine_levels(SAPPHIRE_RAPIDS, refused)[-1] == "avx512-bf16"
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.chosen_level(SAPPHIRE_RAPIDS, refused)[0] == "avx512-bf16"
    monkeypatch.setenv(isa.ENV, "amx")
    with pytest.raises(isa.CPULevelError, match=r"'amx': AMX is advertised .* but the OS refuses this process tile"):
        isa.chosen_level(SAPPHIRE_RAPIDS, refused)
    unsupported = FakePrctl(0xE7, grants=True)  # as seen on 2026-11-28: listed, no tile state
    assert isa.amx_status(SAPPHIRE_RAPIDS, unsupported) == (
        False,
        "advertised (amx_tile amx_int8 amx_bf16) but the OS does not support tile data (ARCH_GET_XCOMP_SUPP)",
    )
    assert unsupported.asked == [isa._ARCH_GET_XCOMP_SUPP]  # nothing requested where nothing is supported
    assert isa.machine_levels(SAPPHIRE_RAPIDS, unsupported)[-1] == "avx512-bf16"
    ok = FakePrctl(0xE7 | TILES, grants=True)
    assert isa.amx_status(SAPPHIRE_RAPIDS, ok) == (
        True,
        "advertised (amx_tile amx_int8 amx_bf16) and granted by the OS",
    )
    assert isa.machine_levels(SAPPHIRE_RAPIDS, ok)[-2:] == ("avx512-bf16", "amx")
    assert isa.chosen_level(SAPPHIRE_RAPIDS, ok) == ("amx", "$PAGEDLLM_CPU_LEVEL")
    monkeypatch.delenv(isa.ENV)
    assert isa.chosen_level(SAPPHIRE_RAPIDS, ok) == ("amx", "the best this CPU and OS run")
    used = "; used: the int8 dots of Q8_0, Q5_0, Q4_0 and IQ4_NL panels, 16 rows of x at a time"
    assert isa.amx_note("amx", SAPPHIRE_RAPIDS, ok).endswith(used)
    assert isa.amx_note("avx2", SAPPHIRE_RAPIDS, ok).endswith("; unused at the avx2 level")
    assert isa.amx_status(CPUS["AVX-512 VNNI"][0], refused) == (False, "not advertised")
    assert isa.amx_note("avx2", CPUS["AVX2"][0]) == ""
    # this machine: the real system call answers (where AMX is listed, the kernel is asked for real)
    granted, why = isa.amx_status()
    assert granted == (why.endswith("granted by the OS"))
    assert ("amx_tile" in isa.cpu_flags()) == (why != "not advertised")
    assert ("amx" in isa.machine_levels()) == (granted and "amx_int8" in isa.cpu_flags())


def test_the_start_up_log_says_why_amx_is_not_used(monkeypatch, caplog):
    from pagedllm import kernels

    monkeypatch.setattr(isa, "amx_status", lambda *a: (False, "advertised (amx_tile) but the OS refuses it"))
    kernels.load.cache_clear(), kernels.try_load.cache_clear()
    try:
        with caplog.at_level("INFO", logger="pagedllm"):
            kernels.load()
    finally:
        kernels.load.cache_clear(), kernels.try_load.cache_clear()
    lines = [r.getMessage() for r in caplog.records]
    assert "AMX: advertised (amx_tile) but the OS refuses it; not used" in lines
    assert any(line.startswith("C kernels: the ") and "amx" not in line for line in lines)  # the next level down
