"""Micro-benchmark of the prefetch planner's per-fetch cost against the size of its window.

    python -m deepspeed_zero3.bench --planner      (or python -m deepspeed_zero3.bench.planner)

One process, no launcher, no collectives: a trace of one-parameter modules, a ``PassPrefetcher`` whose
bucket holds ``window`` of them, and, per simulated fetch, what the coordinator calls on it (``reached``,
``plan``) with the chosen parameters marked in flight. Reported: microseconds per fetch at each window
(median of a few repeats). [Note: constant-cost planning] says why it should be flat; the unit test
``tests/unit/test_prefetch_cost.py`` asserts it by counting executed lines, this shows it in time.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from deepspeed_zero3.bench.tables import text_table

WINDOWS = (2, 10, 50, 100, 500)
MODULES = 4000
REPEATS = 5


def _fake_modules(count: int):
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    modules = []
    for index in range(count):
        param = torch.nn.Parameter(torch.zeros(1))
        param.ds_id, param.ds_numel, param.ds_persist = index, 1, False
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        module = torch.nn.Module()
        module.ds_id = 100_000 + index
        module.register_parameter("weight", param)
        modules.append(module)
    return modules


def per_fetch_us(window: int, modules) -> float:
    """Median over REPEATS of the mean time per fetch of a pass over ``modules`` at ``window``."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
    from deepspeed_zero3.runtime.zero.passes import PassKind
    from deepspeed_zero3.runtime.zero.trace import PassTrace

    trace = PassTrace(PassKind.FORWARD, modules)

    samples = []
    for _ in range(REPEATS):
        for module in modules:
            module.weight.ds_status = ZeroParamStatus.NOT_AVAILABLE
        prefetcher = PassPrefetcher("forward", trace, bucket_numel=window)
        prefetcher.plan(0, 10**12)  # fill the window before timing
        start = time.perf_counter()
        for step in range(len(modules)):
            prefetcher.reached(step)
            for param in prefetcher.plan(0, 10**12):
                param.ds_status = ZeroParamStatus.INFLIGHT
        samples.append((time.perf_counter() - start) / len(modules) * 1e6)
    return statistics.median(samples)


def run(windows=WINDOWS, modules: int = MODULES) -> dict:
    fakes = _fake_modules(modules)
    per_fetch_us(max(windows), fakes)  # warm-up: the first pass pays for allocations and caches
    return {str(window): round(per_fetch_us(window, fakes), 3) for window in windows}


def table(results: dict) -> str:
    smallest = min(results, key=int)
    rows = [(window, f"{us:.2f}", f"{us / results[smallest]:.2f}") for window, us in results.items()]
    return ("prefetch planner, per fetch (reached + plan), one-numel parameters\n"
            + text_table(("window (params)", "us per fetch", f"vs window {smallest}"), rows, align="rrr"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_zero3.bench.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="comma-separated window sizes")
    parser.add_argument("--modules", type=int, default=MODULES, help=f"modules in the trace (default {MODULES})")
    parser.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",") if w.strip()]
    if not windows or min(windows) < 1 or max(windows) >= args.modules:
        parser.error(f"--windows must be >= 1 and < --modules ({args.modules}), got {args.windows!r}")
    results = run(windows, args.modules)
    print(table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"us_per_fetch_by_window": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
