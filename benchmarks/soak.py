"""The long soak: `pagedllm bench soak` on the embedded SmolLM2 (30 minutes unless told otherwise).

    python benchmarks/soak.py [--minutes 30] [--seed 0] [--result-file soak.json] [MODEL]

Starts `pagedllm serve` (its KV cache made resident at start-up), drives it with the seeded mix of
good, careless and hostile clients and bursts past capacity described in pagedllm/benchmarks/soak.py,
then checks that every accepted request completed or was aborted by its own client, that no 5xx other
than backpressure's 503 (with Retry-After) was answered, that the KV cache is empty and the block
pool's invariants hold, and that RSS, file descriptors and threads did not grow. Prints the report as
JSON; exits 1 if anything was wrong. tests/test_soak.py runs the same for 3 minutes on a tiny model.
"""

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--minutes" or a.startswith("--minutes=") for a in args):
        args = ["--minutes", "30", *args]
    sys.exit(main(["bench", "soak", *args]))
