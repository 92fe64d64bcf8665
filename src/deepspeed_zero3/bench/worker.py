"""The benchmark's worker: runs the scenarios on every rank under the DeepSpeed launcher; rank 0 writes JSON.

The driver (``python -m deepspeed_zero3.bench``) starts it twice, once per runtime:

    DEEPSPEED_ZERO3=0 DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 --master_port P \\
        --module deepspeed_zero3.bench.worker --out bench-out/raw/upstream.json --model b ...

Which runtime runs is decided at interpreter start by the kill switch; the worker only reports which
one it got (from the file ``deepspeed.runtime.zero.parameter_offload`` was loaded from).

Measured per cycle, the same way for both runtimes:

* gathers, demand fetches and live gathered numel per phase, by ``GatherMeter`` (an instrument
  outside both runtimes, reading parameter status), with the per-fetch live-numel timeline of each phase;
* trace records: ours from ``deepspeed_zero3.get_zero3_stats`` (the ``trace_records`` of its passes),
  upstream by counting calls of ``PartitionedParameterCoordinator.construct_parameter_trace_from_module_trace``
  (upstream calls it once each time it completes recording a trace);
* wall time of the cycle, between two barriers (and a device synchronize on GPUs), and the CPU time
  the rank's process spent in it (less sensitive to other load on a shared machine).

A scenario that raises is recorded as ``"crash"`` with the exception's type and first line, its engines
are destroyed, and the next scenario runs, unless the ranks disagree about the crash: then their
collectives may be out of step, and the remaining scenarios are recorded as ``"skipped"``.
"""

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

import deepspeed
import deepspeed.runtime.zero.parameter_offload as parameter_offload
from deepspeed_zero3.bench.runtime import runtime_name  # noqa: F401  (the soak worker imports it from here)
import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator_module

from deepspeed_zero3.bench import DEFAULT_BUCKET, DEFAULT_STEPS, DEFAULT_WARMUP, SCENARIOS
from deepspeed_zero3.bench.frontier import FRONTIER_FUNCTIONS, FRONTIER_SCENARIOS
from deepspeed_zero3.bench.scenarios import SCENARIO_FUNCTIONS
from deepspeed_zero3.testing.engines import batch, inference_engine, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.instrument import GatherMeter
from deepspeed_zero3.testing.models import count_params

SCENARIO_TIMEOUT_S = int(os.environ.get("DEEPSPEED_ZERO3_BENCH_SCENARIO_TIMEOUT", "600"))
PG_TIMEOUT_S = int(os.environ.get("DEEPSPEED_ZERO3_BENCH_PG_TIMEOUT", "120"))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


class TraceRecordCounter:
    """How many traces a runtime has recorded so far, read the way each runtime allows."""

    def __init__(self, runtime: str, model):
        self.runtime = runtime
        self.model = model
        self.upstream_calls = 0
        self._saved = None

    def __enter__(self):
        cls = coordinator_module.PartitionedParameterCoordinator
        original = getattr(cls, "construct_parameter_trace_from_module_trace", None)
        if self.runtime == "upstream" and original is not None:
            counter = self

            def construct_parameter_trace_from_module_trace(coordinator, *args, **kwargs):
                counter.upstream_calls += 1
                return original(coordinator, *args, **kwargs)

            self._saved = (cls, original)
            cls.construct_parameter_trace_from_module_trace = construct_parameter_trace_from_module_trace
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            cls, original = self._saved
            cls.construct_parameter_trace_from_module_trace = original
            self._saved = None

    def ours_stats(self):
        import deepspeed_zero3
        try:
            return deepspeed_zero3.get_zero3_stats(self.model)
        except ValueError:  # no engine over the model yet
            return None

    def count(self) -> int:
        if self.runtime == "upstream":
            return self.upstream_calls
        stats = self.ours_stats()
        return 0 if stats is None else sum(t["trace_records"] for t in stats["totals"].values())


class HostTimer:
    """Time spent inside the coordinator's ``fetch_sub_module`` and ``release_sub_module``, both runtimes.

    Installed before the ``GatherMeter`` so that it wraps the coordinator's methods directly and the
    meter's own per-fetch bookkeeping is not counted. Wall time (``perf_counter``) and this thread's CPU
    time (``thread_time``: the hooks run on the thread that runs the pass).
    """

    METHODS = ("fetch_sub_module", "release_sub_module")

    def __init__(self):
        self._saved = []
        self.reset()

    def reset(self):
        self.calls = {name: 0 for name in self.METHODS}
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.depth = 0

    def __enter__(self):
        cls = coordinator_module.PartitionedParameterCoordinator
        for name in self.METHODS:
            original = getattr(cls, name)
            self._saved.append((cls, name, original))
            setattr(cls, name, self._timed(name, original))
        return self

    def __exit__(self, *exc):
        while self._saved:
            cls, name, original = self._saved.pop()
            setattr(cls, name, original)

    def _timed(self, name, original):
        timer = self

        def timed(*args, **kwargs):
            timer.calls[name] += 1
            if timer.depth:  # called from inside a timed call: already counted
                return original(*args, **kwargs)
            timer.depth += 1
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.cpu_seconds += time.thread_time() - cpu_start
                timer.depth -= 1

        return timed

    def snapshot(self) -> dict:
        return {"fetch_calls": self.calls["fetch_sub_module"], "release_calls": self.calls["release_sub_module"],
                "seconds": self.seconds, "cpu_seconds": self.cpu_seconds}


class Bench:
    """What a scenario uses: the config, engines, and the phase markers the instrument reads."""

    def __init__(self, args, rank: int, device: torch.device):
        self.args = args
        self.rank = rank
        self.device = device
        self.config = zero3_config(bucket=args.bucket, reuse=args.reuse)
        self.meter = None
        self.passes = Counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.passes[name] += 1
        with (self.meter.phase(name) if self.meter is not None else contextlib.nullcontext()):
            yield

    def training_engine(self, model):
        return training_engine(model, self.config)

    def inference_engine(self, model):
        return inference_engine(model, self.config)

    def train_step(self, engine, step: int, shape=(4, 16)):
        x = batch(step, self.rank, shape=shape).to(self.device)
        with self.phase("forward"):
            loss = mse_loss(engine(x))
        with self.phase("backward"):
            engine.backward(loss)
        with self.phase("step"):
            engine.step()

    def eval_forward(self, engine, step: int):
        x = batch(step, self.rank).to(self.device)
        engine.eval()
        with torch.no_grad(), self.phase("eval_forward"):
            engine(x)
        engine.train()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        torch.distributed.barrier()


def run_scenario(name: str, bench: Bench, runtime: str) -> dict:
    record = {"status": "ok", "error": None, "cycles": [], "timeline": {}}
    plan = None
    try:
        plan = (FRONTIER_FUNCTIONS.get(name) or SCENARIO_FUNCTIONS[name])(bench)
        warmup = bench.args.warmup if plan.warmup is None else plan.warmup
        measured = bench.args.steps if plan.measured is None else plan.measured
        record.update(label=plan.label, numel=count_params(plan.model), warmup=warmup, measured=measured)
        meter = GatherMeter(plan.model, keep_timeline=True)
        with HostTimer() as host, meter, TraceRecordCounter(runtime, plan.model) as records:
            bench.meter = meter
            for index in range(warmup + measured):
                meter.reset()
                host.reset()
                bench.passes.clear()
                records_before = records.count()
                bench.sync()
                start, cpu_start = time.perf_counter(), time.process_time()
                plan.cycle(index)
                bench.sync()
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                phases = meter.snapshot()
                record["timeline"] = {phase: counts.pop("timeline") for phase, counts in phases.items()}
                record["timeline_cycle"] = index
                record["cycles"].append({
                    "index": index,
                    "measured": index >= warmup,
                    "seconds": seconds,
                    "cpu_seconds": cpu_seconds,  # this rank's process CPU time: less sensitive to a busy machine
                    "phases": phases,
                    "passes": dict(bench.passes),
                    "trace_records": records.count() - records_before,
                    "host": host.snapshot(),
                })
            if runtime == "ours":
                stats = records.ours_stats()
                record["ours_stats_totals"] = None if stats is None else stats["totals"]
    except Exception as exc:
        record.update(status="crash", error=first_line(exc))
        sys.stderr.write(f"[rank {bench.rank}] scenario {name} crashed:\n{traceback.format_exc()}\n")
    finally:
        bench.meter = None
        for engine in reversed(plan.engines if plan is not None else []):
            try:
                engine.destroy()
            except Exception:  # the scenario's own error is what gets recorded
                traceback.print_exc()
        plan = None
        gc.collect()
    return record


def write_json(path: Path, results: dict):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="deepspeed-zero3 benchmark worker (run by the driver)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--model", choices=("a", "b"), default="b")
    parser.add_argument("--bucket", type=int, default=None)
    parser.add_argument("--reuse", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--local_rank", type=int, default=-1)  # appended by the launcher
    args, _ = parser.parse_known_args(argv)
    if args.bucket is None:
        args.bucket = DEFAULT_BUCKET[args.model]
    args.scenarios = [s for s in SCENARIOS + FRONTIER_SCENARIOS if s in args.scenarios.split(",")]
    return args


def init_process_group():
    """gloo on CPU (one share of the cores per rank), NCCL when there are GPUs; returns (rank, world, device, backend)."""
    use_cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    local_size = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if not use_cuda:
        # The ranks share this machine's cores: more threads than cores per rank makes gloo runs ~10x slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))
    backend = "nccl" if use_cuda else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device, backend


def main(argv=None):
    args = parse_args(argv)
    rank, world, device, backend = init_process_group()
    use_cuda = device.type == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Crash agreement has its own group, so it never pairs with a collective a crashed rank left half done.
    status_group = torch.distributed.new_group(backend="gloo",
                                               timeout=datetime.timedelta(seconds=2 * PG_TIMEOUT_S + 30))
    runtime = runtime_name()
    out = Path(args.out)
    results = {
        "meta": {
            "runtime": runtime,
            "parameter_offload": parameter_offload.__file__,
            "partitioned_param_coordinator": coordinator_module.__file__,
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "world": world,
            "backend": backend,
            "device": torch.cuda.get_device_name(local_rank) if use_cuda else "cpu",
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "model": args.model,
            "bucket": args.bucket,
            "reuse": args.reuse,
            "steps": args.steps,
            "warmup": args.warmup,
        },
        "progress": {"running": None, "done": []},
        "scenarios": {},
    }
    bench = Bench(args, rank, device)
    stopped = None
    for name in args.scenarios:
        if stopped is not None:
            results["scenarios"][name] = {"status": "skipped", "error": f"not run: ranks out of step after {stopped}"}
            continue
        if rank == 0:
            results["progress"]["running"] = name
            write_json(out, results)
        start = time.time()
        faulthandler.dump_traceback_later(SCENARIO_TIMEOUT_S, exit=True)
        record = run_scenario(name, bench, runtime)
        try:
            per_rank = [None] * world
            torch.distributed.all_gather_object(per_rank, (record["status"], record["error"]), group=status_group)
            if len(set(per_rank)) != 1:
                record.update(status="crash", error="; ".join(f"rank {r}: {e or s}" for r, (s, e) in enumerate(per_rank)))
                stopped = name
        except Exception as exc:
            record.update(status="crash", error=f"{record['error']}; rank agreement failed: {first_line(exc)}")
            stopped = name
        faulthandler.cancel_dump_traceback_later()
        record["seconds"] = round(time.time() - start, 3)
        results["scenarios"][name] = record
        if rank == 0:
            results["progress"]["done"].append(name)
            print(f"[bench {runtime}] {name}: {record['status']} in {record['seconds']:.1f}s"
                  + (f" ({record['error']})" if record["error"] else ""), flush=True)
    results["progress"]["running"] = None
    if rank == 0:
        write_json(out, results)
    if stopped is None:
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # A crashed scenario's leftovers (hooks, in-flight handles) must not hold the process at exit.
    os._exit(0)


if __name__ == "__main__":
    main()
