"""The instruction-set level the C kernels are built for: one explicit choice, from what the CPU *and* the OS allow.

Levels, lowest first (x86-64; elsewhere the one level is ``native``, the compiler's own choice for the machine):

* ``portable``: x86-64 as every 64-bit x86 CPU runs it (SSE2): the plain-C paths;
* ``avx2``: x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE (and x86-64-v2's SSE4.2, POPCNT, ...): Intel since
  Haswell, AMD since Zen 1;
* ``avx2-vnni``: ``avx2`` and AVX-VNNI's int8 dot products on 256-bit registers (Intel Alder Lake and later
  client CPUs, AMD Zen 5);
* ``avx512-vnni``: AVX-512 F/BW/CD/DQ/VL (x86-64-v4) and AVX-512 VNNI (Intel since Cascade Lake, AMD Zen 4
  and 5): the GGUF panels' AVX-512 kernels (``gguf_panels_avx512.h``) here and above, AVX2's below;
* ``avx512-bf16``: ``avx512-vnni`` and AVX512_BF16's bfloat16 dot products (Intel since Cooper Lake / Sapphire
  Rapids, AMD Zen 4 and 5): attention over a bfloat16 KV cache multiplies bfloat16 pairs (``vdpbf16ps``); every
  other kernel is ``avx512-vnni``'s;
* ``amx``: ``avx512-bf16`` and AMX's int8 tile multiplies (Intel Xeon since Sapphire Rapids), only where the OS
  grants this process tile data (below): the GGUF panel GEMM's integer dots of Q8_0, Q5_0, Q4_0 and IQ4_NL for 16
  rows of x at a time (``gguf_panels_amx.h``, the same bits as ``avx512-vnni``'s); every other kernel is
  ``avx512-bf16``'s.

The machine's levels are those whose features ``/proc/cpuinfo`` lists. Linux lists a feature only where the OS
saves its registers (it clears AVX and AVX-512 when XCR0 does not enable their state), so a listed level is one
the OS allows too. ``$PAGEDLLM_CPU_LEVEL`` chooses any level the machine runs (not every level below the best:
Zen 4 and Ice Lake run ``avx512-vnni`` but have no AVX-VNNI), so each can be tested and measured on one
machine; by default the best is built. ``native`` builds for every feature the compiler sees in the CPU
(``-march=native``), to compare a level against. The choice is logged where the kernels load.

AMX is the one feature /proc/cpuinfo's word is not enough for: a CPU that advertises it is asked, as any AMX code
must ask before its first tile instruction, whether the OS grants this process the tile data (:func:`amx_status`:
the kernel's supported extended features, then ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); some
virtual machines list ``amx_tile`` in ``/proc/cpuinfo`` and trap the first tile instruction (llama.cpp built
``GGML_NATIVE`` dies there with SIGILL). Where it is refused, the ``amx`` level is not the machine's, and the
best of the rest runs; the answer is logged beside the level either way.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

ENV = "PAGEDLLM_CPU_LEVEL"
LEVELS = ("portable", "avx2", "avx2-vnni", "avx512-vnni", "avx512-bf16", "amx")
NATIVE = "native"  # not x86-64: the compiler's -march=native, the only level
# what gcc's -march=x86-64-v3 may emit (x86-64-v2's SSE3 ("pni") to POPCNT, then AVX2, BMI1/2, F16C, FMA,
# LZCNT ("abm"), MOVBE, XSAVE), by /proc/cpuinfo's names: a level is the machine's only if it lists every one
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_AVX2 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_AVX512_VNNI = _AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
_NEEDS: dict[str, frozenset[str]] = {
    "portable": frozenset(),
    "avx2": _AVX2,
    "avx2-vnni": _AVX2 | {"avx_vnni"},
    "avx512-vnni": _AVX512_VNNI,
    "avx512-bf16": _AVX512_VNNI | {"avx512_bf16"},
    "amx": _AVX512_VNNI | {"avx512_bf16", "amx_tile", "amx_int8"},  # and the OS's grant of tile data
}
_MARCH: dict[str, list[str]] = {
    "portable": ["-march=x86-64"],
    "avx2": ["-march=x86-64-v3"],
    "avx2-vnni": ["-march=x86-64-v3", "-mavxvnni"],
    "avx512-vnni": ["-march=x86-64-v4", "-mavx512vnni"],
    "avx512-bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
    "amx": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8"],
    NATIVE: ["-march=native"],
}


_AMX = ("amx_tile", "amx_int8", "amx_bf16")
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_SUPP, _ARCH_REQ_XCOMP_PERM = 0x1021, 0x1023
_XFEATURE_XTILEDATA = 18


def _arch_prctl(code: int, arg: int) -> tuple[int, int]:
    """The arch_prctl system call: (its result, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_int(code), ctypes.c_ulong(arg))
    return result, ctypes.get_errno()


def _xcomp_supported(prctl: Callable[[int, int], tuple[int, int]]) -> int | None:
    """The extended features the kernel supports (ARCH_GET_XCOMP_SUPP's mask), or None where it will not say."""
    mask = ctypes.c_ulong(0)
    result, _ = prctl(_ARCH_GET_XCOMP_SUPP, ctypes.addressof(mask))
    return mask.value if result == 0 else None


def amx_status(
    flags: frozenset[str] | None = None, prctl: Callable[[int, int], tuple[int, int]] | None = None
) -> tuple[bool, str]:
    """(whether this process may use AMX tiles, why): AMX must be listed in ``/proc/cpuinfo`` (``flags``), the
    kernel must support tile data among its extended features, and grant it to this process when asked
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, Linux 5.16 and later). ``prctl``: the system call, for tests."""
    flags = cpu_flags() if flags is None else flags
    listed = [f for f in _AMX if f in flags]
    if "amx_tile" not in listed or not is_x86():
        return False, "not advertised"
    prctl = _arch_prctl if prctl is None else prctl
    supported = _xcomp_supported(prctl)
    if supported is None or not supported >> _XFEATURE_XTILEDATA & 1:
        return False, f"advertised ({' '.join(listed)}) but the OS does not support tile data (ARCH_GET_XCOMP_SUPP)"
    result, errno = prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if result != 0:
        return False, (
            f"advertised ({' '.join(listed)}) but the OS refuses this process tile data "
            f"(ARCH_REQ_XCOMP_PERM: {os.strerror(errno)})"
        )
    return True, f"advertised ({' '.join(listed)}) and granted by the OS"


def amx_note(
    level: str,
    flags: frozenset[str] | None = None,
    prctl: Callable[[int, int], tuple[int, int]] | None = None,
) -> str:
    """The start-up log's words on AMX for a run at ``level``: empty where the CPU does not advertise it."""
    granted, why = amx_status(flags, prctl)
    if why == "not advertised":
        return ""
    if not granted:
        use = "not used"
    elif level == "amx":
        use = "used: the int8 dots of Q8_0, Q5_0, Q4_0 and IQ4_NL panels, 16 rows of x at a time"
    else:
        use = f"unused at the {level} level"
    return f"AMX: {why}; {use}"


class CPULevelError(ValueError):
    """``$PAGEDLLM_CPU_LEVEL`` names no level, or one this machine cannot run."""


def cpu_flags() -> frozenset[str]:
    """The feature flags ``/proc/cpuinfo`` lists for the first CPU (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def machine_levels(
    flags: frozenset[str] | None = None, prctl: Callable[[int, int], tuple[int, int]] | None = None
) -> tuple[str, ...]:
    """The levels this CPU and OS run, lowest first (``("native",)`` off x86-64). ``flags``: /proc/cpuinfo's;
    ``amx`` only where the OS grants tile data (:func:`amx_status`, asking through ``prctl``: for tests)."""
    if flags is None:
        if not is_x86():
            return (NATIVE,)
        flags = cpu_flags()
    listed = [level for level in LEVELS if _NEEDS[level] <= flags]
    if "amx" in listed and not amx_status(flags, prctl)[0]:
        listed.remove("amx")
    return tuple(listed)


def chosen_level(
    flags: frozenset[str] | None = None, prctl: Callable[[int, int], tuple[int, int]] | None = None
) -> tuple[str, str]:
    """(the level to build, why): ``$PAGEDLLM_CPU_LEVEL`` where set, else the machine's best (``flags`` and
    ``prctl`` as :func:`machine_levels` takes them)."""
    levels = machine_levels(flags, prctl)
    asked = os.environ.get(ENV, "").strip().lower()
    if not asked:
        return levels[-1], "the best this CPU and OS run"
    if asked == NATIVE:  # every feature the CPU lists, as the compiler sees them: to compare a level against
        return NATIVE, f"${ENV}"
    if asked not in LEVELS:
        raise CPULevelError(f"${ENV}={asked!r} is not a level; the levels: {', '.join(LEVELS)}, native")
    if asked not in levels:
        if levels == (NATIVE,):
            raise CPULevelError(f"${ENV}={asked!r} is an x86-64 level, and this machine is not x86-64: use native")
        missing = sorted(_NEEDS[asked] - (flags if flags is not None else cpu_flags()))
        if not missing:  # the amx level on a CPU that lists AMX: the OS does not grant it
            why = amx_status(flags, prctl)[1]
            raise CPULevelError(f"${ENV}={asked!r}: AMX is {why}; its levels: {', '.join(levels)}")
        raise CPULevelError(
            f"${ENV}={asked!r} needs what this machine lacks ({', '.join(missing)}); its levels: {', '.join(levels)}"
        )
    return asked, f"${ENV}"


def compile_flags(level: str) -> list[str]:
    """The compiler's instruction-set flags for ``level`` (tuned for this machine: tuning never adds
    instructions)."""
    return [*_MARCH[level], *([] if level == NATIVE else ["-mtune=native"])]
