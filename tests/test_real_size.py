"""benchmarks/real_size.py's summary of several rounds, on figures given here (no engine runs)."""

import pytest

from utils import benchmark_module

rs = benchmark_module("real_size")


def _figures(ttft_128: float, ttft_512: float, decode: float, rss: float, **more: float) -> dict[str, float]:
    return {"ttft_128_ms": ttft_128, "ttft_512_ms": ttft_512, "decode_tok_s": decode, "peak_rss_gib": rss, **more}


def test_rounds_give_each_figures_median_and_each_rounds_own_ratios() -> None:
    rounds = [
        {
            "llama.cpp": _figures(100, 400, 20, 1.0),
            "pagedllm gguf": _figures(60, 240, 24, 1.1, ready_s=3),
            "transformers": _figures(900, 3600, 2, 10.0),  # its run is round 1's only
        },
        {  # a slow stretch of the machine: both engines' figures at half speed
            "llama.cpp": _figures(200, 800, 10, 1.0),
            "pagedllm gguf": _figures(130, 500, 11, 1.2, ready_s=5),
        },
        {"llama.cpp": _figures(100, 420, 21, 1.0), "pagedllm gguf": _figures(70, 252, 22, 1.1, ready_s=4)},
    ]
    medians, ratios = rs.summary(rounds)
    assert list(medians) == ["llama.cpp", "pagedllm gguf", "transformers"]
    assert medians["pagedllm gguf"] == _figures(70, 252, 22, 1.1, ready_s=4)
    assert medians["llama.cpp"] == _figures(100, 420, 20, 1.0)  # no start-up figures of its own
    assert medians["transformers"] == _figures(900, 3600, 2, 10.0)
    assert set(ratios) == {"pagedllm gguf", "transformers"}  # llama.cpp is what the others are divided by
    got = ratios["pagedllm gguf"]
    assert got["ttft_128_ms"] == pytest.approx([0.6, 0.65, 0.7])
    assert got["ttft_512_ms"] == pytest.approx([0.6, 0.625, 0.6])
    assert got["decode_tok_s"] == pytest.approx([1.2, 1.1, 22 / 21])
    assert set(got) == {"ttft_128_ms", "ttft_512_ms", "decode_tok_s", "peak_rss_gib"}
    # each round's ratio, not the ratio of the medians: 0.65 against 70 / 100 for the 128-token TTFT
    assert ratios["transformers"]["decode_tok_s"] == pytest.approx([0.1])
