"""Host time per module fetch + release of the tiny-module model, in one process or more, optionally profiled.

    python -m deepspeed_zero3.bench.hostcost [--reuse 1000000000] [--profile] [--trip]
    DEEPSPEED_ZERO3=0 python -m deepspeed_zero3.bench.hostcost      # upstream's runtime
    deepspeed --num_gpus 2 --no_local_rank --module deepspeed_zero3.bench.hostcost --reuse 1000000000   # 2 ranks

Under the launcher the ranks run the package installed in the environment: reinstall it (``make venv``)
after changing ``src/``; rank 0 prints the coordinator's file. In one process there is no other rank to
wait for: what is left is host work (bookkeeping, upstream's partition and gather calls); under the
launcher each rank also pays for splitting the real gathers.
Builds the ``tiny_modules`` model of the benchmark, runs 3 warm-up training steps, times
``fetch_sub_module`` and ``release_sub_module`` over 3 more (wall and this thread's CPU time), and with
``--profile`` prints a cProfile of 2 further steps (sorted by ``--sort``). ``--trip`` prints the runtime files one
module's fetch and release pass through (ours and upstream's, under ``runtime/``) and how many calls cross from
one of them to another, traced with ``sys.setprofile`` around the middle module of a forward. Run it under the
heavy lock like any benchmark.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_zero3.bench.hostcost", description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", type=int, default=0, help="stage3_max_reuse_distance (default 0)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of two more steps")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key (default tottime)")
    parser.add_argument("--lines", type=int, default=30, help="cProfile lines shown (default 30)")
    parser.add_argument("--trip", action="store_true", help="print the runtime files one module's fetch and release "
                        "pass through, and the calls between them")
    parser.add_argument("--dump", default=None, help="with --profile: also write the raw cProfile stats here "
                        "(rank appended), for pstats' callers/callees views")
    args = parser.parse_args(argv)

    from deepspeed_zero3.testing.ports import free_port
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    import torch
    import deepspeed
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator_module
    from deepspeed_zero3.bench.scenarios import DEEPSPEED_DEFAULT_BUCKET, TINY_MODULES, TINY_WIDTH
    from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(8)
    model = torch.nn.Sequential(*(torch.nn.Linear(TINY_WIDTH, TINY_WIDTH) for _ in range(TINY_MODULES)))
    engine = training_engine(model, zero3_config(bucket=DEEPSPEED_DEFAULT_BUCKET, reuse=args.reuse))

    def step(i):
        loss = mse_loss(engine(batch(i, 0, shape=(4, TINY_WIDTH))))
        engine.backward(loss)
        engine.step()

    for i in range(3):
        step(i)
    cls = coordinator_module.PartitionedParameterCoordinator
    spent = {"seconds": 0.0, "cpu_seconds": 0.0, "fetches": 0}
    saved = []
    for name in ("fetch_sub_module", "release_sub_module"):
        original = getattr(cls, name)
        saved.append((name, original))

        def timed(*a, _original=original, _name=name, **k):
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return _original(*a, **k)
            finally:
                spent["seconds"] += time.perf_counter() - start
                spent["cpu_seconds"] += time.thread_time() - cpu_start
                spent["fetches"] += _name == "fetch_sub_module"

        setattr(cls, name, timed)
    for i in range(3, 6):
        step(i)
    for name, original in saved:
        setattr(cls, name, original)
    from deepspeed_zero3.bench.runtime import runtime_name
    runtime = runtime_name()
    print(f"{runtime}: {1e6 * spent['seconds'] / spent['fetches']:.1f} us per module fetch + release, "
          f"{1e6 * spent['cpu_seconds'] / spent['fetches']:.1f} us of it CPU (rank {torch.distributed.get_rank()} of "
          f"{torch.distributed.get_world_size()}, reuse {args.reuse}, "
          f"{spent['fetches']} fetches)")
    if torch.distributed.get_rank() == 0:
        # Under the launcher the ranks import the installed package, not this checkout's src/: a stale
        # install measures old code.
        print(f"coordinator: {coordinator_module.__file__}")
    if args.trip:
        files, crossings = trip(cls, model[TINY_MODULES // 2], lambda: step(8))
        print(f"trip: one module's fetch + release passes through {len(files)} runtime files, {crossings} calls "
              f"between them: " + ", ".join(files))
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for i in range(6, 8):
            step(i)
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.lines)
        if args.dump:
            profile.dump_stats(f"{args.dump}.{os.environ['RANK']}")
    sys.stdout.flush()
    os._exit(0)  # the process group and engine need no orderly teardown here


def runtime_file(path: str):
    """The short name of a runtime file of ours or upstream's (``zero3:gather.py``, ``deepspeed:stage3.py``), None for
    any other file."""
    for marker, label in (("/deepspeed_zero3/runtime/", "zero3"), ("/deepspeed/runtime/", "deepspeed")):
        if marker in path:
            return f"{label}:{path.split(marker, 1)[1]}"
    return None


def trip(cls, module, run_step):
    """Trace ``module``'s forward fetch and release during ``run_step()``: the runtime files entered, in order of
    first entry, and the calls whose caller and callee are different runtime files."""
    files, crossings, tracing = {}, [0], [False]

    def profiler(frame, event, _arg):
        if event != "call":
            return
        callee = runtime_file(frame.f_code.co_filename)
        if callee is None:
            return
        files.setdefault(callee, None)
        caller = runtime_file(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if caller is not None and caller != callee:
            crossings[0] += 1

    saved = []
    for name in ("fetch_sub_module", "release_sub_module"):
        original = getattr(cls, name)
        saved.append((name, original))

        def traced(self, sub_module, *a, _original=original, **k):
            watch = sub_module is module and not tracing[0] and not torch_grad_engine_running()
            if watch:
                sys.setprofile(profiler)
            try:
                return _original(self, sub_module, *a, **k)
            finally:
                if watch:
                    sys.setprofile(None)

        setattr(cls, name, traced)
    try:
        run_step()
    finally:
        for name, original in saved:
            setattr(cls, name, original)
    return list(files), crossings[0]


def torch_grad_engine_running() -> bool:
    """Inside a backward: the trip follows the forward's fetch and release only."""
    import torch
    return torch._C._current_graph_task_id() != -1


if __name__ == "__main__":
    sys.exit(main())
