"""The GPU benchmark: ``python -m deepspeed_zero3.bench.gpu [--model llama-bench] [--out gpu-out]``.

A Llama of about 130M parameters (8 layers, hidden 1024, sequence 256) at world size 1, offloaded
parameters, both runtimes one after the other; prints the table (report.py) and leaves the JSON, logs and
profiler traces in --out.
"""

import argparse
import sys
from pathlib import Path

from deepspeed_zero3.bench.gpu.report import table
from deepspeed_zero3.bench.gpu.runs import RUNTIMES, launch, log_tail


def main(argv=None):
    parser = argparse.ArgumentParser(description="deepspeed-zero3 GPU benchmark, ours vs upstream")
    parser.add_argument("--model", default="llama-bench", choices=("b", "llama", "llama-bench"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    failed = False
    for runtime in RUNTIMES:
        result = launch(runtime, out, f"bench-{args.model}",
                        ["--model", args.model, "--steps", str(args.steps), "--phases", "parity,syncs,time,profile"],
                        timeout_s=args.timeout)
        print(f"{runtime}: rc={result['rc']} in {result['seconds']} s")
        if result["rc"] != 0:
            failed = True
            print(log_tail(result), file=sys.stderr)
    print(table(out, "bench"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
