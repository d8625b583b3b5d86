"""Microbenchmarks of the CPU hot path, each against its PyTorch reference in the same run.

    python benchmarks/cpu_kernels.py linear      # SmolLM2's projections + head: F.linear (MKL) vs oneDNN packed
    python benchmarks/cpu_kernels.py attention   # 64 decodes of W64-like lengths: gather + SDPA vs paged kernel

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
    from pagedllm.layers.linear import PackedLinear

    weights = [torch.randn(n, k) for n, k in SHAPES]
    packed = [PackedLinear(w, None) for w in weights]
    for m in rows:
        xs = {k: torch.randn(m, k) for _, k in SHAPES}
        flops = sum(2 * m * n * k for n, k in SHAPES) / 1e9
        reps = max(1, int(2000 / (m + 30)))
        mkl = _best(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], reps)
        dnn = _best(lambda: [p(xs[p.in_features]) for p in packed], reps)
        print(f"rows {m:5d}: F.linear {mkl * 1e3:8.2f} ms ({flops / mkl:6.1f} GFLOP/s)   "
              f"oneDNN packed {dnn * 1e3:8.2f} ms ({flops / dnn:6.1f} GFLOP/s)   {mkl / dnn:.2f}x")


def bench_attention(num_decodes: int, block_size: int = 16, heads: int = 9, kv_heads: int = 3,
                    head_dim: int = 64) -> None:
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
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=table,
                             seq_lens=torch.tensor(lens), num_decodes=num_decodes,
                             query_start_loc=list(range(num_decodes + 1)), seq_lens_cpu=lens, block_size=block_size)

    def run(decode):
        meta.scratch.clear()
        return decode(q, cache, meta, head_dim ** -0.5, None)

    torch.testing.assert_close(run(cpu_paged._decode), run(torch_ref._decode), rtol=1e-5, atol=1e-5)
    ref, ker = _best(lambda: run(torch_ref._decode), 5), _best(lambda: run(cpu_paged._decode), 20)
    gb = sum(lens) * kv_heads * head_dim * 2 * 4 / 1e9
    print(f"{num_decodes} decodes, {sum(lens)} cached tokens ({gb * 1e3:.0f} MB of K/V) per layer: "
          f"gather + SDPA {ref * 1e3:.2f} ms   paged kernel {ker * 1e3:.2f} ms ({gb / ker:.1f} GB/s)   "
          f"{ref / ker:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["linear", "attention"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512], help="batch rows (linear)")
    p.add_argument("--num-decodes", type=int, default=64, help="requests in the decode batch (attention)")
    args = p.parse_args()
    if args.what == "linear":
        bench_linear(args.rows)
    else:
        bench_attention(args.num_decodes)


if __name__ == "__main__":
    main()
