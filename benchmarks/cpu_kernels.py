"""Microbenchmarks of the CPU hot path, each against its PyTorch reference in the same run.

    python benchmarks/cpu_kernels.py linear      # SmolLM2's projections + head: F.linear (MKL) vs oneDNN packed
                                                 # (and PackedLinear's own GEMV for decode's few rows)
    python benchmarks/cpu_kernels.py attention   # 64 decodes of W64-like lengths: gather + SDPA vs paged kernel
    python benchmarks/cpu_kernels.py prefill     # one request's prefill (chunk) after a cached context:
                                                 # gather + SDPA (torch_ref) vs the flash-style paged kernel
    python benchmarks/cpu_kernels.py quant       # SmolLM2's projections (int4) + head (int8): float32 oneDNN vs
                                                 # the float-activation kernels vs int8 activations (w4a8) vs
                                                 # int16 activations (w4a16); above 16 rows the integer GEMM
    python benchmarks/cpu_kernels.py gguf        # Qwen2.5-1.5B's MLP + head shapes, one row: a GGUF's Q4_K / Q6_K
                                                 # blocks as stored (gguf_blocks.c) vs the converted int4 / int8
                                                 # layouts (gguf_loader._q_blocks) vs float32 oneDNN
    python benchmarks/cpu_kernels.py panels --types Q4_K Q6_K --rows 512
                                                 # the panel GEMM (int8 x, the blocks repacked at load) over
                                                 # Qwen2.5-1.5B's four linear shapes, GMAC/s, at the level that
                                                 # $PAGEDLLM_CPU_LEVEL names (two trees: run it from each, in turn)

Times are the best of several repeats (this machine is noisy); ratios are what to read.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: qkv, o, gate_up, down, and the head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _best(fn, reps: int, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def bench_linear(rows: list[int]) -> None:
    from pagedllm.layers.linear import GEMV_ROWS, PackedLinear

    weights = [torch.randn(n, k) for n, k in SHAPES]
    packed = [PackedLinear(w, None) for w in weights]
    gemv = [PackedLinear(w, None, gemv=True) for w in weights]  # its own kernel up to GEMV_ROWS rows
    for m in rows:
        xs = {k: torch.randn(m, k) for _, k in SHAPES}
        flops = sum(2 * m * n * k for n, k in SHAPES) / 1e9
        reps = max(1, int(2000 / (m + 30)))
        mkl = _best(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], reps)
        dnn = _best(lambda: [p(xs[p.in_features]) for p in packed], reps)
        line = (
            f"rows {m:5d}: F.linear {mkl * 1e3:8.2f} ms ({flops / mkl:6.1f} GFLOP/s)   "
            f"oneDNN packed {dnn * 1e3:8.2f} ms ({flops / dnn:6.1f} GFLOP/s)   {mkl / dnn:.2f}x"
        )
        if m <= GEMV_ROWS:
            for g, p in zip(gemv, packed):  # the same bits as oneDNN, or it stands aside
                assert torch.equal(g(xs[g.in_features]), p(xs[p.in_features]))
            own = _best(lambda: [g(xs[g.in_features]) for g in gemv], reps)
            line += f"   own GEMV {own * 1e3:8.2f} ms ({dnn / own:.2f}x oneDNN)"
        print(line)


def bench_attention(
    num_decodes: int, block_size: int = 16, heads: int = 9, kv_heads: int = 3, head_dim: int = 64
) -> None:
    from pagedllm.attention import AttentionMetadata, cpu_paged, torch_ref

    rng = random.Random(0)
    lens = [rng.randint(32, 512) + 64 for _ in range(num_decodes)]
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks) + 1).tolist()
    cache = torch.randn(2, sum(blocks) + 1, block_size, kv_heads, head_dim)
    table = torch.zeros(num_decodes, max(blocks), dtype=torch.long)
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q = torch.randn(num_decodes, heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_tables=table,
        seq_lens=torch.tensor(lens),
        num_decodes=num_decodes,
        query_start_loc=list(range(num_decodes + 1)),
        seq_lens_cpu=lens,
        block_size=block_size,
    )

    def run(decode):
        meta.scratch.clear()
        return decode(q, cache, meta, head_dim**-0.5, None)

    torch.testing.assert_close(run(cpu_paged._decode), run(torch_ref._decode), rtol=1e-5, atol=1e-5)
    ref, ker = _best(lambda: run(torch_ref._decode), 5), _best(lambda: run(cpu_paged._decode), 20)
    gb = sum(lens) * kv_heads * head_dim * 2 * 4 / 1e9
    print(
        f"{num_decodes} decodes, {sum(lens)} cached tokens ({gb * 1e3:.0f} MB of K/V) per layer: "
        f"gather + SDPA {ref * 1e3:.2f} ms   paged kernel {ker * 1e3:.2f} ms ({gb / ker:.1f} GB/s)   "
        f"{ref / ker:.2f}x"
    )


def bench_prefill(block_size: int = 16, heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> None:
    """SmolLM2's attention shape; (queries, cached tokens) as W64's prefill chunks have them."""
    from pagedllm.attention import cpu_paged, torch_ref

    for q_len, ctx in [(128, 0), (512, 0), (512, 512), (256, 1024), (2048, 0)]:
        n = ctx + q_len
        nb = -(-n // block_size)
        table = torch.randperm(nb + 1)[:nb]
        cache = torch.randn(2, nb + 1, block_size, kv_heads, head_dim)
        q, k, v = torch.randn(q_len, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
        pos = torch.arange(ctx, n)
        cache[0, table[pos // block_size], pos % block_size] = k
        cache[1, table[pos // block_size], pos % block_size] = v
        out = torch.empty(q_len, heads, head_dim)

        def ref():  # as torch_ref.paged_attention runs one request: its own K/V, or the context gathered
            kc, vc = (k, v) if ctx == 0 else torch_ref._gather(cache, table, n, block_size)
            return torch_ref._prefill(q, kc, vc, ctx, head_dim**-0.5, None)

        def ker():
            cpu_paged._prefill(q, k, v, cache, table, ctx, head_dim**-0.5, None, out)
            return out

        torch.testing.assert_close(ker(), ref(), rtol=1e-4, atol=1e-5)
        flops = 4 * heads * head_dim * (q_len * ctx + q_len * (q_len + 1) / 2)
        tr, tk = _best(ref, 5), _best(ker, 5)
        print(
            f"{q_len:5d} queries after {ctx:5d} cached: gather + SDPA {tr * 1e3:7.2f} ms ({flops / tr / 1e9:5.1f} "
            f"GFLOP/s)   paged kernel {tk * 1e3:7.2f} ms ({flops / tk / 1e9:5.1f} GFLOP/s)   {tr / tk:.2f}x"
        )


def bench_quant(rows: list[int]) -> None:
    """Each kernel checked against its reference first: the float-activation kernels against F.linear on
    the dequantized weights, the integer-activation ones against F.linear on the rounded input."""
    from pagedllm import kernels
    from pagedllm.layers.linear import PackedLinear
    from pagedllm.layers.quantization import quantize_int4, quantize_int8

    k = kernels.load()
    weights = [torch.randn(n, kk) for n, kk in SHAPES]
    blocks = [(quantize_int8 if n == 49152 else quantize_int4)(w) for w, (n, _) in zip(weights, SHAPES)]
    float_act = [k.int8_matmul if n == 49152 else k.int4_matmul for n, _ in SHAPES]
    int8_act = [k.int8_matmul_a8 if n == 49152 else k.int4_matmul_a8 for n, _ in SHAPES]
    int16_act = [k.int8_matmul_a16 if n == 49152 else k.int4_matmul_a16 for n, _ in SHAPES]
    dequant = [(k.int8_dequantize if n == 49152 else k.int4_dequantize)(*b) for b, (n, _) in zip(blocks, SHAPES)]
    packed = [PackedLinear(w, None) for w in weights]
    for m in rows:
        xs = [torch.randn(m, kk) for _, kk in SHAPES]
        for x, b, wd, f, a, a16 in zip(xs, blocks, dequant, float_act, int8_act, int16_act):
            torch.testing.assert_close(f(x, *b), F.linear(x, wd), rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(a(x, *b), F.linear(k.round_activations(x, 8), wd), rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(a16(x, *b), F.linear(k.round_activations(x, 16), wd), rtol=1e-4, atol=1e-3)
        reps = max(1, int(300 / (m + 10)))
        gb = sum(b[0].numel() + 2 * b[1].numel() * 4 for b in blocks) / 1e9
        f32 = _best(lambda: [p(x) for p, x in zip(packed, xs)], reps)
        fa = _best(lambda: [f(x, *b) for f, x, b in zip(float_act, xs, blocks)], reps)
        a8 = _best(lambda: [a(x, *b) for a, x, b in zip(int8_act, xs, blocks)], reps)
        a16 = _best(lambda: [a(x, *b) for a, x, b in zip(int16_act, xs, blocks)], reps)
        print(
            f"rows {m:4d}: float32 oneDNN {f32 * 1e3:7.2f} ms   int4/int8 float activations {fa * 1e3:7.2f} ms "
            f"({f32 / fa:.2f}x)   int8 activations {a8 * 1e3:7.2f} ms ({f32 / a8:.2f}x, {fa / a8:.2f}x the "
            f"float-activation kernels; {gb / a8:.1f} GB/s of weights)   int16 activations {a16 * 1e3:7.2f} ms "
            f"({f32 / a16:.2f}x)"
        )


# Qwen2.5-Coder-1.5B: gate / up, down, the tied head (N, K)
GGUF_SHAPES = {"gate/up": (8960, 1536), "down": (1536, 8960), "head": (151936, 1536)}


def _median(fn, calls: int, copies: int = 1) -> float:
    """Median seconds of ``fn(i)``, i cycling through ``copies`` (of the weight: so that they stream from memory
    as a model's layers do, not from the last level cache)."""
    fn(0)
    times = []
    for c in range(calls):
        t = time.perf_counter()
        fn(c % copies)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _k_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    """n rows of random Q4_K (12) / Q6_K (14) super-blocks, [n, bytes a row] uint8, with float16 scales of a
    realistic size (the speed does not depend on the values)."""
    size = 144 if qtype == 12 else 210
    raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8)
    scale = torch.empty(n, k // 256, 1, dtype=torch.float16).uniform_(1e-4, 3e-3).view(torch.uint8)
    for at in (0, 2) if qtype == 12 else (208,):
        raw[..., at : at + 2] = scale
    return raw.view(n, -1)


def bench_gguf(calls: int) -> None:
    """One row (single-stream decode) per shape: median µs a call and GB/s of weight bytes read (each layout's
    own bytes). Each kernel is checked against float32 on the same weights first."""
    from gguf import GGMLQuantizationType as T

    from pagedllm import kernels
    from pagedllm.layers.linear import PackedLinear
    from pagedllm.model_loader.gguf_loader import _identity, _q_blocks_in_slices

    kern = kernels.load()
    g = kern.gguf
    print(f"{'shape':8s} {'N x K':>14s}  {'kernel':44s} {'us/call':>9s} {'GB/s':>6s} {'MB read':>8s}")
    for name, (n, k) in GGUF_SHAPES.items():
        x = torch.randn(1, k)
        copies = max(1, -(-256 * 2**20 // (n * k)))  # >= 128 MiB of Q4_K weights a cycle: beyond the L3 cache
        rows: list[tuple[str, float, int]] = []

        def add(label: str, fn, nbytes: int, n_calls: int = calls) -> None:
            rows.append((label, _median(fn, n_calls, copies), nbytes))

        for qtype, label in ((12, "Q4_K"), (14, "Q6_K")):
            raws = [_k_blocks(qtype, n, k) for _ in range(copies)]
            w = g.dequantize(qtype, raws[0])
            ref = F.linear(x, w)
            torch.testing.assert_close(g.matmul_f32(qtype, x, raws[0]), ref, rtol=1e-3, atol=1e-3)
            xr = g.round_activations(x, 256)
            torch.testing.assert_close(g.matmul_a8(qtype, x, raws[0]), F.linear(xr, w), rtol=1e-3, atol=1e-3)
            add(f"{label} as stored, int8 act (new)", lambda i: g.matmul_a8(qtype, x, raws[i]), raws[0].numel())
            add(f"{label} as stored, float act (new)", lambda i: g.matmul_f32(qtype, x, raws[i]), raws[0].numel())
            conv = [_q_blocks_in_slices(r.numpy(), T(qtype), _identity)[1] for r in raws]
            q, sc, mn = conv[0]
            if qtype == 12:  # int8 activations per 32 here: another rounding, so checked by its float twin
                torch.testing.assert_close(kern.int4_matmul(x, q, sc, mn), ref, rtol=1e-3, atol=1e-3)
                nbytes = q.numel() + 4 * (sc.numel() + mn.numel())
                add("Q4_K -> int4, int8 act (int4_matmul_a8)", lambda i: kern.int4_matmul_a8(x, *conv[i]), nbytes)
                add("Q4_K -> int4, float act (int4_matmul)", lambda i: kern.int4_matmul(x, *conv[i]), nbytes)
            else:  # a scale per 16, mins all 0: the int8 g16 kernel (float activations only)
                torch.testing.assert_close(kern.int8_matmul_g16(x, q, sc, None), ref, rtol=1e-3, atol=1e-3)
                nbytes = q.numel() + 4 * sc.numel()
                add(
                    "Q6_K -> int8/16, float act (int8_matmul_g16)",
                    lambda i: kern.int8_matmul_g16(x, conv[i][0], conv[i][1], None),
                    nbytes,
                )
        packed = [PackedLinear(w, None) for _ in range(min(copies, 2))]  # 2 x 55 MB: enough to leave the cache
        rows.append(
            (
                "float32 oneDNN (PackedLinear)",
                _median(lambda i: packed[i](x), max(5, calls // 4), len(packed)),
                n * k * 4,
            )
        )
        for label, t, nbytes in rows:
            print(f"{name:8s} {n:6d} x {k:5d}  {label:44s} {t * 1e6:9.1f} {nbytes / t / 1e9:6.1f} {nbytes / 1e6:8.1f}")


# Qwen2.5-1.5B's linear shapes (N, K): q / o, k / v, gate / up, down
PANEL_SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]
# where a block's float16 scale(s) lie, by type (the rest of its bytes random): the K-quants' d (and dmin) and the
# 32-blocks' d (and m)
_SCALE_AT = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
}


def _random_blocks(name: str, n: int, k: int) -> torch.Tensor:
    """n rows of random blocks of type ``name``, with float16 scales of a realistic size (speed does not depend on
    the values)."""
    import gguf

    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    raw = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8)
    for at in _SCALE_AT.get(name, (0,)):
        scale = torch.empty(n, k // elems, 1, dtype=torch.float16).uniform_(1e-4, 3e-3)
        raw[..., at : at + 2] = scale.view(torch.uint8)
    return raw.view(n, -1)


def bench_panels(types: list[str], rows: list[int]) -> None:
    """GMAC/s of the GGUF panel GEMM (int8 x) for each type, row count and shape: the best of 3 timed runs of about
    3e9 multiply-adds each (run it from two trees in turn to compare them)."""
    import gguf

    from pagedllm import kernels

    g = kernels.load().gguf
    print(f"threads {torch.get_num_threads()}")
    for name in types:
        qtype = int(gguf.GGMLQuantizationType[name])
        for m in rows:
            rates = []
            for n, k in PANEL_SHAPES:
                ptype, w = g.pack(qtype, _random_blocks(name, n, k))
                x = torch.randn(m, k)
                g.matmul_a8(ptype, x, w)
                reps, best = max(1, int(3e9 // (m * n * k))), float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(reps):
                        g.matmul_a8(ptype, x, w)
                    best = min(best, (time.perf_counter() - t) / reps)
                rates.append(f"{n}x{k} {m * n * k / best / 1e9:5.0f}")
            print(f"{name:6s} {m:4d} rows  " + "  ".join(rates) + "  GMAC/s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["linear", "attention", "prefill", "quant", "gguf", "panels"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512], help="batch rows (linear, panels)")
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"], help="GGUF block types (panels)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per kernel, the median reported (gguf)")
    p.add_argument("--num-decodes", type=int, default=64, help="requests in the decode batch (attention)")
    args = p.parse_args()
    if args.what == "linear":
        bench_linear(args.rows)
    elif args.what == "quant":
        bench_quant(args.rows)
    elif args.what == "gguf":
        bench_gguf(args.calls)
    elif args.what == "panels":
        bench_panels(args.types, args.rows)
    elif args.what == "prefill":
        bench_prefill()
    else:
        bench_attention(args.num_decodes)


if __name__ == "__main__":
    main()
