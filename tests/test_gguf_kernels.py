"""gguf_blocks.c: a GGUF's Q4_K / Q6_K / Q8_0 / Q5_0 blocks run as stored, against gguf's own dequantization.

Each kernel is checked in a build of the same source at every instruction-set level this machine runs
(pagedllm.kernels.isa: portable C, AVX2, AVX2 + AVX-VNNI, AVX-512 VNNI), so every path is the oracle-checked
function whatever machine runs the suite.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from pagedllm.kernels import isa  # noqa: E402
from pagedllm.kernels.build import library_flags  # noqa: E402
from pagedllm.kernels.ops import GGUFBlocks  # noqa: E402

TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0]  # read as the file stores them and in panels
# in panels (all but TYPES only there)
PANEL_TYPES = [*TYPES, T.Q5_K, T.Q4_0, T.Q4_1, T.Q5_1, T.IQ4_NL, T.IQ4_XS, T.Q3_K, T.Q2_K]
PAIRED_TYPES = (T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1, T.Q5_1, T.IQ4_NL)  # panels of pairs of 32-blocks
SRC = os.path.join(os.path.dirname(__file__), "..", "pagedllm", "kernels", "gguf_blocks.c")
LEVELS = isa.machine_levels()  # every instruction-set level this machine runs (pagedllm.kernels.isa)


@pytest.fixture(scope="session", params=LEVELS)
def blocks(request, tmp_path_factory) -> GGUFBlocks:
    """gguf_blocks.c compiled for one instruction-set level (the package's own build at its level)."""
    from pagedllm import kernels

    if kernels.load().level == request.param:
        return kernels.load().gguf
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler")
    so = tmp_path_factory.mktemp("gguf_blocks") / f"gguf_blocks_{request.param}.so"
    subprocess.run([cc, *library_flags(request.param), SRC, "-o", str(so)], check=True, capture_output=True)
    return GGUFBlocks(ctypes.CDLL(str(so)))


def random_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k weights in ``qtype``'s blocks, [n, bytes a row] uint8. gguf quantizes Q8_0 / Q5_0 / Q4_0 / Q4_1 /
    Q5_1 (those two from rows of mostly one sign, so that a block's min is large beside d); the others are random
    bytes (every bit pattern is a valid block) with float16 scales of a realistic size."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q5_0, T.Q4_0):
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05, qtype)
    if qtype in (T.Q4_1, T.Q5_1):
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05 + rng.uniform(-0.2, 0.2, (n, 1)).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    if qtype in (T.IQ4_NL, T.IQ4_XS, T.Q3_K, T.Q2_K):  # random bytes, float16 scales of a realistic size
        elems, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
        for at in {T.Q3_K: (108,), T.Q2_K: (80, 82)}.get(qtype, (0,)):
            d = rng.uniform(1e-4, 1e-3, (n, k // elems, 1)) / {T.IQ4_NL: 1, T.IQ4_XS: 16}.get(qtype, 4)
            raw[..., at : at + 2] = d.astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    size = {T.Q4_K: 144, T.Q5_K: 176}.get(qtype, 210)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)

    def scale() -> np.ndarray:
        return rng.uniform(1e-4, 3e-3, (n, k // 256, 1)).astype(np.float16).view(np.uint8)

    if qtype in (T.Q4_K, T.Q5_K):
        raw[..., 0:2], raw[..., 2:4] = scale(), scale()
    else:
        raw[..., 208:210] = scale()
    return raw.reshape(n, -1)


def reference_weights(qtype: T, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


def reference_rounding(x: torch.Tensor, block: int) -> torch.Tensor:
    """llama.cpp's Q8_K (block 256) / our Q8_0 activations (block 32): d = 1 / (127 / max|x|), q = round(x * 127 /
    max|x|) ties to even, as q * d."""
    g = x.view(x.shape[0], -1, block)
    amax = g.abs().amax(-1, keepdim=True)
    one = torch.ones_like(amax)  # tensor / tensor: a scalar numerator would multiply by a reciprocal
    iscale = torch.where(amax > 0, 127 * one / amax, 0 * one)
    d = torch.where(amax > 0, one / iscale, 0 * one)
    return (torch.round(g * iscale) * d).view_as(x)


def assert_matches(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float = 1e-5) -> None:
    """y == x @ w.T to ``rel`` of the sum of the products' magnitudes (a bound that cancellation cannot break)."""
    ref = x.double() @ w.double().T
    bound = rel * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = ((y.double() - ref).abs() / bound).max().item()
    assert err <= 1, f"off by {err:.2f}x the tolerance"


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_ggufs_bit_for_bit(blocks, qtype):
    raw = random_blocks(qtype, 37, 768)
    w = blocks.dequantize(int(qtype), torch.from_numpy(raw))
    assert torch.equal(w, reference_weights(qtype, raw))


@pytest.mark.parametrize("block", [256, 32])
def test_activation_rounding_is_llama_cpps(blocks, block):
    x = torch.randn(5, 1024) * torch.logspace(-3, 2, 1024)[torch.randperm(1024)]
    x[1, :256] = 0  # an all-zero block: d = 0
    q, d, sums = blocks.quantize(x, block)
    ref = reference_rounding(x, block)
    torch.testing.assert_close(q.float() * d.repeat_interleave(block, 1), ref, rtol=0, atol=0)
    assert torch.equal(blocks.round_activations(x, block), ref)
    assert torch.equal(sums.long(), q.long().view(5, -1, 16).sum(-1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [*range(1, 10), 14])
def test_int8_activation_gemv_is_the_dequantized_weights_on_the_rounded_input(blocks, qtype, m):
    """Every count of rows that share a decoded block (1 to 6), then full tiles of 6 and a remainder (7-9, 14)."""
    n, k = 53, 1280  # 53 rows: not a multiple of the threads' share
    raw = random_blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k)
    y = blocks.matmul_a8(int(qtype), x, torch.from_numpy(raw))
    assert_matches(y, reference_rounding(x, blocks.activation_block(int(qtype))), reference_weights(qtype, raw))


@pytest.fixture
def gemm_from(blocks):
    """Sets how many rows of integer activations the panel GEMM starts above (then back to the default)."""
    default = blocks.gemm_min_rows

    def set_rows(rows: int) -> GGUFBlocks:
        blocks.gemm_min_rows = rows
        return blocks

    yield set_rows
    blocks.gemm_min_rows = default


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7, 8, 9, 17])
def test_int8_activation_gemm_is_the_same_function(gemm_from, qtype, m):
    """The panel GEMM (every row count here; the row kernels where a build has no GEMM): 53 weight rows, so the
    last panel of 16 is partial, and tiles of 8 rows with a remainder."""
    blocks = gemm_from(0)
    n, k = 53, 1280
    raw = random_blocks(qtype, n, k, seed=10 + m)
    if qtype == T.Q8_0:  # q = -128 too, which gguf's quantizer never writes but a file may hold
        raw.reshape(n, -1, 34)[:, ::3, 2:6] = 0x80
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)[torch.randperm(k)]
    y = blocks.matmul_a8(int(qtype), x, torch.from_numpy(raw))
    assert_matches(y, reference_rounding(x, blocks.activation_block(int(qtype))), reference_weights(qtype, raw))
    q, d, sums = blocks.quantize(x, blocks.activation_block(int(qtype)))
    assert torch.equal(blocks.matmul_q8(int(qtype), q, d, sums, torch.from_numpy(raw)), y)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_int8_path_gives_a_row_the_same_bits_whatever_shares_its_call(gemm_from, qtype):
    """The row kernels (any count of rows sharing a decoded block) and the panel GEMM (any tile) each compute a
    row alone: its result does not depend on the other rows of its call."""
    n, k, m = 53, 1280, 21
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=3))
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)[torch.randperm(k)]
    for rows in (1 << 30, 0):  # the row kernels, then the GEMM (where a build has one)
        blocks = gemm_from(rows)
        alone = torch.cat([blocks.matmul_a8(int(qtype), x[i : i + 1], raw) for i in range(m)])
        assert torch.equal(blocks.matmul_a8(int(qtype), x, raw), alone)
        assert torch.equal(blocks.matmul_a8(int(qtype), x[5:12], raw), alone[5:12])


@pytest.mark.parametrize(
    "qtype, k",
    [*((t, 1280) for t in PANEL_TYPES), *((t, 896) for t in PAIRED_TYPES)],  # 896: no 256s
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_repacked_panels_give_a_row_the_same_bits_at_every_row_count(gemm_from, qtype, k):
    """A weight repacked into panels of 16 rows (where a build has the panel kernels: AVX2 and up) runs one
    kernel at every row count: a row's bits are the same alone (a decode step), beside a few others (a
    speculative verification, a small batch) or in a prefill chunk; they are the same at every level that has
    the panels (AVX2's two halves of 8 lanes compute AVX-512's 16), and on AVX-512 VNNI the file layout's GEMM's;
    its rows and its dequantized values come back as the file's. The types not in TYPES are read in panels only (as
    the file stores them, only dequantized: a row looked up). Below AVX2, for rows not in whole panels, and for rows
    of an odd number of 32-blocks (their panels hold blocks in pairs), nothing repacks."""
    from pagedllm import kernels

    blocks = gemm_from(0)  # AVX-512 VNNI: the file's layout through the GEMM at every row count
    n, m = 48, 70
    raw_np = random_blocks(qtype, n, k, seed=5)
    if qtype == T.Q8_0:  # q = -128 too, which gguf's quantizer never writes but a file may hold
        raw_np.reshape(n, -1, 34)[:, ::3, 2:6] = 0x80
    raw = torch.from_numpy(raw_np)
    ptype, packed = blocks.pack(int(qtype), raw)
    if not blocks.has_panels:
        assert ptype == int(qtype) and packed is raw
        return
    assert ptype == 100 + int(qtype) and packed.shape == raw.shape and not torch.equal(packed, raw)
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)[torch.randperm(k)]
    want = torch.cat([blocks.matmul_a8(ptype, x[i : i + 1], packed) for i in range(m)])
    assert_matches(want, reference_rounding(x, blocks.activation_block(int(qtype))), reference_weights(qtype, raw_np))
    if blocks.has_gemm and qtype in TYPES:
        assert torch.equal(blocks.matmul_a8(int(qtype), x, raw), want)
    machine = kernels.load().gguf
    if machine.has_panels:  # the machine's own level (the package's build) gives the same bits
        assert torch.equal(machine.matmul_a8(ptype, x, machine.pack(int(qtype), raw)[1]), want)
    for rows in (2, 3, 4, 5, 6, 8, 9, 11, 17, 24, 40, 41, 70):  # tiles of 4 (AVX2) and 8; in place, then expanded
        assert torch.equal(blocks.matmul_a8(ptype, x[:rows], packed), want[:rows]), rows
    assert torch.equal(blocks.matmul_a8(ptype, x[20:29], packed), want[20:29])
    ids = torch.tensor([0, 47, 16, 15, 3, 3])
    assert torch.equal(blocks.unpack_rows(ptype, packed, ids), raw[ids])
    assert torch.equal(blocks.dequantize(ptype, packed), blocks.dequantize(int(qtype), raw))
    with pytest.raises(IndexError, match="row ids"):
        blocks.unpack_rows(ptype, packed, torch.tensor([48]))
    with pytest.raises(ValueError, match="ggml type"):  # the float kernels read the file's layout only
        blocks.matmul_f32(ptype, x[:1], packed)
    assert blocks.pack(int(qtype), raw[:40])[0] == int(qtype)
    if qtype not in TYPES:  # the file's layout: looked up (dequantized), never multiplied
        with pytest.raises(ValueError, match=f"does not read ggml type {int(qtype)}"):
            blocks.matmul_a8(int(qtype), x[:1], raw)
    if qtype in PAIRED_TYPES:
        odd = torch.from_numpy(random_blocks(qtype, n, k - 32))
        assert blocks.pack(int(qtype), odd)[1] is odd
        with pytest.raises(ValueError, match="raw must be"):  # a panel's blocks come in pairs
            blocks.in_features(ptype, odd)


@pytest.mark.parametrize("q6", [0, 63])
def test_q6k_panels_at_the_ends_of_their_int16_sums(gemm_from, q6):
    """AVX2's expanded Q6_K tiles (above 8 rows, no AVX-VNNI) sum a group's four words of (q - 32) . x in int16,
    starting from -32 sum(x), where 4 words of q . x alone would overflow: with every q at 0 and x at +-127 a lane
    holds -32,512 throughout; with every q at 63 it climbs from -32,512 to 31,496. A row's bits are those of the row
    alone (read in place), at every level, and its values gguf's."""
    blocks = gemm_from(0)
    n, k, m = 32, 512, 24
    raw_np = random_blocks(T.Q6_K, n, k, seed=7)
    raw_np.reshape(n, -1, 210)[..., :192] = 0 if q6 == 0 else 0xFF  # ql and qh: every q at q6
    x = torch.ones(m, k)
    x[1::3] = -1  # +-127 once rounded
    x[2::3] = torch.randn(m // 3, k)
    ptype, packed = blocks.pack(int(T.Q6_K), torch.from_numpy(raw_np))
    if not blocks.has_panels:
        pytest.skip("no panels below AVX2")
    want = torch.cat([blocks.matmul_a8(ptype, x[i : i + 1], packed) for i in range(m)])
    assert_matches(want, reference_rounding(x, 256), reference_weights(T.Q6_K, raw_np))
    for rows in (9, 16, 24):
        assert torch.equal(blocks.matmul_a8(ptype, x[:rows], packed), want[:rows]), rows


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, *PAIRED_TYPES], ids=lambda t: t.name)
def test_amx_tiles_give_each_row_the_bits_of_avx512_vnni(qtype):
    """At the amx level (where the OS grants tile data) the panel GEMM's tiles of 16 rows of x multiply on AMX for
    Q8_0, Q5_0, Q4_0 and IQ4_NL (tdpbssd on the words less their offset, then the same float multiply-add a block);
    the other types keep AVX-512 VNNI's tiles there. Each row's bits equal the same build's AVX-512 VNNI tiles:
    repacked panels past 40 rows, the file's layout past 16 (a last panel of fewer columns), a last tile of fewer
    than 16 rows padded, and a K whose count of 32-blocks is no multiple of 4 (the tiles take four at a time)."""
    from pagedllm import kernels

    machine = kernels.load()
    if machine.level != "amx":
        pytest.skip(f"the machine's kernels are at the {machine.level} level, not amx (no AMX tile data granted)")
    blocks = machine.gguf
    cases = [(48, 1280, True), (48, 1216 if qtype in PAIRED_TYPES else 1536, True)]
    if qtype in TYPES:
        cases.append((53, 1280, False))  # the file's layout through the GEMM
    try:
        for n, k, repack in cases:
            raw_np = random_blocks(qtype, n, k, seed=k)
            if qtype == T.Q8_0:  # q = -128 too, which a file may hold
                raw_np.reshape(n, -1, 34)[:, ::3, 2:6] = 0x80
            raw = torch.from_numpy(raw_np)
            ptype, w = blocks.pack(int(qtype), raw) if repack else (int(qtype), raw)
            assert (ptype > 100) == repack
            for m in (17, 41, 70):
                x = torch.randn(m, k) * torch.logspace(-2, 1, k)[torch.randperm(k)]
                blocks.use_amx = False
                want = blocks.matmul_a8(ptype, x, w)
                blocks.use_amx = True
                assert torch.equal(blocks.matmul_a8(ptype, x, w), want), (n, k, repack, m)
                if repack:  # and a row alone (the in-place kernels) the same bits again
                    alone = torch.cat([blocks.matmul_a8(ptype, x[i : i + 1], w) for i in range(0, m, 7)])
                    assert torch.equal(want[::7], alone)
    finally:
        blocks.use_amx = True


def test_a_nan_row_stays_nan_in_the_gemm_and_leaves_the_others_finite(gemm_from):
    blocks = gemm_from(0)
    raw = torch.from_numpy(random_blocks(T.Q4_K, 20, 512))
    x = torch.randn(11, 512)
    x[9, 300] = float("nan")
    y = blocks.matmul_a8(int(T.Q4_K), x, raw)
    assert y[9].isnan().all() and y[torch.arange(11) != 9].isfinite().all()


@pytest.mark.parametrize("m", [1, 5, 9, 40])
def test_a_fused_projection_in_one_call_is_each_shards_call_bit_for_bit(gemm_from, m):
    """A Q4_K_M file's q | k | v (Q4_K, Q4_K, Q6_K) with a Q8_0 shard (another rounding block) in one call:
    each shard's columns equal its own call, through the row kernels and (40 rows) the panel GEMM."""
    blocks = gemm_from(16)
    k = 512
    types = [T.Q4_K, T.Q4_K, T.Q6_K, T.Q8_0]
    raws = [torch.from_numpy(random_blocks(t, n, k, seed=n)) for t, n in zip(types, [48, 16, 21, 33], strict=True)]
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)[torch.randperm(k)]
    y = blocks.matmul_a8_parts([int(t) for t in types], x, raws)
    assert torch.equal(y, torch.cat([blocks.matmul_a8(int(t), x, r) for t, r in zip(types, raws, strict=True)], 1))
    if blocks.has_panels:  # repacked shards too: Q4_1 / Q5_1 (a min a block) beside Q4_K (another rounding block)
        packed = [
            blocks.pack(int(t), torch.from_numpy(random_blocks(t, n, k, seed=n)))
            for t, n in [(T.Q4_1, 32), (T.Q5_1, 16)]
        ]
        parts = [(int(T.Q4_K), raws[0]), *packed]
        y = blocks.matmul_a8_parts([t for t, _ in parts], x, [r for _, r in parts])
        assert [t for t, _ in packed] == [103, 107]
        assert torch.equal(y, torch.cat([blocks.matmul_a8(t, x, r) for t, r in parts], 1))
    with pytest.raises(ValueError, match="features"):
        blocks.matmul_a8_parts([int(T.Q4_K)], torch.randn(1, 256), raws[:1])
    with pytest.raises(ValueError, match="ggml type 2"):
        q4_0 = torch.zeros(4, 18 * k // 32, dtype=torch.uint8)
        blocks.matmul_a8_parts([int(T.Q4_K), int(T.Q4_0)], x, [raws[0], q4_0])


def test_an_infinite_input_makes_its_block_nan_and_leaves_the_others_alone(blocks):
    x = torch.randn(2, 512)
    x[1, 300] = float("inf")
    q, d, sums = blocks.quantize(x, 256)
    assert d[1, 1].isnan() and not q[1, 256:].any() and not sums[1, 16:].any()
    assert torch.equal(d[0], blocks.quantize(x[:1], 256)[1][0]) and d[1, 0].isfinite()
    assert blocks.round_activations(x, 256)[1, 256:].isnan().all()
    y = blocks.matmul_a8(int(T.Q4_K), x, torch.from_numpy(random_blocks(T.Q4_K, 8, 512)))
    assert y[0].isfinite().all() and y[1].isnan().all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 4, 9])
def test_float_activation_gemv_is_the_dequantized_weights(blocks, qtype, m):
    n, k = 53, 1280
    raw = random_blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k)
    assert_matches(blocks.matmul_f32(int(qtype), x, torch.from_numpy(raw)), x, reference_weights(qtype, raw))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1536, 1000, 7])  # whole vectors; a tail after them; only a tail
def test_half_weights_are_widened_exactly_and_a_rows_bits_ignore_what_shares_its_call(blocks, dtype, k):
    """An F16 / BF16 GGUF matrix as stored: float32 products of the weights widened exactly, at every level, and
    each row of x the same bits alone as beside up to 40 others (the 'gguf' mode runs it at every row count)."""
    n = 45
    w = (torch.randn(n, k) * 0.05).to(dtype)
    w[3, : min(k, 5)] = torch.tensor([0.0, -0.0, 6e-8, -65504.0, 1e-3])[: min(k, 5)].to(dtype)  # zero, subnormal, large
    x = torch.randn(41, k)
    y = blocks.matmul_half(x, w)
    assert_matches(y, x, w.float())
    for m in (1, 2, 5, 6, 7, 13):
        assert torch.equal(blocks.matmul_half(x[:m].contiguous(), w), y[:m])
        assert torch.equal(blocks.matmul_half(x[m : m + 1].contiguous(), w), y[m : m + 1])
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        blocks.matmul_half(x, w.float())
    with pytest.raises(ValueError, match=f"float32 \\[M, {k}\\]"):
        blocks.matmul_half(x[:, :-1].contiguous() if k > 1 else x, w)


def test_bfloat16_dot_products_round_x_and_give_a_row_the_same_bits_whatever_shares_its_call(blocks):
    """A BF16 matrix under 'gguf' on AVX512_BF16: panels of 16 rows (the file's bytes permuted, put back exactly),
    x rounded to bfloat16 to nearest even as llama.cpp rounds it, products summed in float32: each row of x the
    same bits alone as beside up to 40 others, and every tail of rows and of panels."""
    for n in (96, 112):  # tiles of four panels then two, then three
        w = (torch.randn(n, 64) * 0.05).to(torch.bfloat16)
        panels = blocks.pack_bf16(w)
        if panels is not None:
            x = torch.randn(7, 64)
            assert_matches(blocks.matmul_bf16_dot(x, panels), x.bfloat16().float(), w.float())
    n, k = 80, 1000  # five panels: a tile of four and one alone
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    panels = blocks.pack_bf16(w)
    if not blocks.has_bf16_dot:
        assert panels is None  # this level has no bfloat16 dot products: HalfLinear keeps float32 products
        return
    assert panels is not None and panels.shape == w.shape and not torch.equal(panels, w)
    assert torch.equal(blocks.unpack_bf16(panels), w)
    ids = torch.tensor([0, 17, 79, 17, 42])
    assert torch.equal(blocks.unpack_bf16(panels, ids), w[ids])
    x = torch.randn(41, k)
    y = blocks.matmul_bf16_dot(x, panels)
    assert_matches(y, x.bfloat16().float(), w.float())
    assert not torch.equal(y, blocks.matmul_half(x, w))  # x was rounded: not float32's products
    for m in (1, 2, 5, 6, 7, 13):
        assert torch.equal(blocks.matmul_bf16_dot(x[:m].contiguous(), panels), y[:m])
        assert torch.equal(blocks.matmul_bf16_dot(x[m : m + 1].contiguous(), panels), y[m : m + 1])
    assert blocks.pack_bf16(w[:40]) is None and blocks.pack_bf16(w[:, :999].contiguous()) is None  # no whole panels


def test_a_nan_in_the_input_makes_its_row_nan_not_finite(blocks):
    raw = torch.from_numpy(random_blocks(T.Q4_K, 8, 512))
    x = torch.randn(2, 512)
    x[1, 300] = float("nan")
    y = blocks.matmul_a8(int(T.Q4_K), x, raw)
    assert y[0].isfinite().all() and y[1].isnan().all()


GROUP_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT16_FIELDS = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # else (0,)


def any_blocks(qtype: T, shape: tuple[int, ...], k: int, seed: int = 0) -> np.ndarray:
    """Rows of k weights in ``qtype``'s blocks, [*shape, bytes a row] uint8: random bytes (every bit pattern of
    the quants and scales) with float16 fields of every finite kind: zeros, subnormals, negatives, large."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape, k // block, size), dtype=np.uint8)
    for off in FLOAT16_FIELDS.get(qtype, (0,)):
        bits = rng.integers(0, 1 << 16, raw.shape[:-1], dtype=np.uint16)
        bits[(bits >> 10) & 31 == 31] ^= 1 << 14  # no infinity or NaN
        bits.flat[:4] = [0, 0x8000, 1, 0x83FF]  # +0, -0 and subnormals
        raw[..., off : off + 2] = bits[..., None].view(np.uint8)
    return raw.reshape(*shape, -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("qtype", GROUP_TYPES, ids=lambda t: t.name)
def test_the_group_layout_conversion_is_numpys_bit_for_bit(blocks, qtype):
    """gguf_blocks.c's gguf_to_groups (what the int4 / int8 layouts of a GGUF load through) against the numpy
    conversion it replaced, every tensor bit for bit: -0.0 and the float16 subnormals included."""
    from pagedllm.model_loader.gguf_loader import _identity, _q_blocks_numpy

    raw = any_blocks(qtype, (7,), 768 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 96)
    want_kind, want = _q_blocks_numpy(raw, qtype, _identity)
    kind, got = blocks.to_groups(int(qtype), raw)
    assert kind == want_kind
    for g, w in zip(got, want, strict=True):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert torch.equal(_bits(g), _bits(w))


def test_the_loader_converts_in_c_with_numpys_shapes():
    """_q_blocks (the loader's entry) runs the C conversion, also for a tensor of more than two dimensions (the
    experts of a MoE: [E, N, bytes]) and a row permutation, with what numpy gives."""
    from pagedllm.model_loader import gguf_loader

    assert gguf_loader._group_kernels() is not None
    raw = any_blocks(T.Q4_K, (3, 4), 512, seed=1)
    for fix in (gguf_loader._identity, lambda r: r[::-1]):
        kind, got = gguf_loader._q_blocks(raw, T.Q4_K, fix)
        want = gguf_loader._q_blocks_numpy(raw, T.Q4_K, fix)[1]
        assert kind == "int4" and all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=True))
    assert gguf_loader._q_blocks(raw, T.IQ3_XXS, gguf_loader._identity) is None  # no layout: dequantized instead


def test_a_conversion_of_a_type_without_a_layout_or_of_torn_rows_is_refused(blocks):
    with pytest.raises(ValueError, match="no group layout for ggml type 10"):
        blocks.to_groups(int(T.Q2_K), np.zeros((2, 84), np.uint8))
    with pytest.raises(ValueError, match="a multiple of 144 bytes"):
        blocks.to_groups(int(T.Q4_K), np.zeros((2, 100), np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        blocks.to_groups(int(T.Q8_0), np.zeros((2, 136), np.uint8)[:, :68])


def test_unknown_types_are_refused(blocks):
    with pytest.raises(ValueError, match="ggml type"):
        blocks.matmul_a8(int(T.Q4_0), torch.randn(1, 32), torch.zeros(4, 18, dtype=torch.uint8))


@pytest.mark.parametrize("activation_bits", [8, None])
def test_a_stacked_linear_is_its_shards_side_by_side(activation_bits):
    from pagedllm.layers.gguf_linear import stacked_gguf

    k, sizes, names = 512, [32, 16, 24], ["Q4_K", "Q4_K", "Q6_K"]
    raws = tuple(torch.from_numpy(random_blocks(T[t], n, k, seed=n)) for t, n in zip(names, sizes, strict=True))
    bias = torch.randn(sum(sizes))
    layer = stacked_gguf(names, raws, bias, activation_bits)
    for m in (1, 3, 40):
        x = torch.randn(m, k)
        want = torch.cat([p(x) for p in layer.parts], 1) + bias
        assert torch.equal(layer(x), want)
        xb = x.bfloat16()
        assert torch.equal(layer(xb.view(1, m, k)), layer(xb.float()).bfloat16().view(1, m, -1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("activation_bits", [8, None])
def test_gguf_linear_is_one_function_at_every_batch_size(qtype, activation_bits):
    from pagedllm.layers.gguf_linear import GGUFLinear
    from pagedllm.layers.quantization import SMALL_BATCH

    n, k = 40, 512
    raw = random_blocks(qtype, n, k)
    bias = torch.randn(n)
    layer = GGUFLinear(torch.from_numpy(raw), int(qtype), bias, activation_bits)
    x = torch.randn(4 * SMALL_BATCH + 4, k)  # the GEMMs: dequantized + float32, or int8 over panels
    batched, rows = layer(x), torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    w, b = layer.dequantized()
    assert torch.equal(w, reference_weights(qtype, raw)) and b is layer.bias
    xr = reference_rounding(x, 256 if qtype in (T.Q4_K, T.Q6_K) else 32) if activation_bits else x
    for y in (batched, rows):
        assert_matches(y - bias, xr, w)
    assert layer(x.view(2, -1, k)).shape == (2, x.shape[0] // 2, n)


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_a_gguf_mode_linear_on_repacked_panels_is_one_function_bit_for_bit(qtype):
    """GGUFLinear under int8 activations repacks its rows where the CPU has the panel kernels: every
    batch size then gives each row the bits it gets alone, and a lookup of its rows (a tied embedding's) is the
    file's rows dequantized. Q5_K and Q4_0, read in panels only, are refused by name where they cannot be."""
    from pagedllm import kernels
    from pagedllm.layers.gguf_linear import GGUFLinear

    n, k = 48, 512
    raw = random_blocks(qtype, n, k, seed=9)
    packs = kernels.load().gguf.has_panels
    if qtype not in TYPES:
        for rows, bits in ((raw[:40], 8), (raw, None), *([] if packs else [(raw, 8)])):
            with pytest.raises(ValueError, match=rf"type {int(qtype)} \({qtype.name}\) only in panels"):
                GGUFLinear(torch.from_numpy(rows), int(qtype), None, bits)
        if not packs:
            return
    layer = GGUFLinear(torch.from_numpy(raw), int(qtype), torch.randn(n), 8)
    assert layer.qtype == (100 + int(qtype) if packs else int(qtype)) and layer.file_qtype == int(qtype)
    assert ("in panels of 16 rows" in repr(layer)) == packs
    x = torch.randn(70, k)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    if packs:
        assert torch.equal(layer(x), alone) and torch.equal(layer(x[:5]), alone[:5])
    w, _ = layer.dequantized()
    assert torch.equal(w, reference_weights(qtype, raw))
    ids = torch.tensor([7, 0, 47, 16])
    assert torch.equal(layer.rows(ids), w[ids])
