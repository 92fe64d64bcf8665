"""NVMe against CPU parameter offload, both runtimes, in one run: ``python -m deepspeed_zero3.bench.offload``.

Four launches, one at a time (offload device x runtime), each training the NVMe parity model
(tests/parity/scenarios_nvme.py: bf16, hidden size 1024, every Linear(1024, 1024) partition 1 MiB per rank)
for --warmup + --steps steps on 2 CPU ranks. Reported per device and runtime: median wall and CPU time per
training step on rank 0, ours/upstream, whether the losses are bitwise equal, and for ours the swap-ins per
steady-state pass (ahead of use, on demand, unused). Timings are noisy on a shared machine: read the ratios,
taken in the same run, not the absolute times.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deepspeed_zero3.bench.tables import markdown_table
from deepspeed_zero3.testing.launching import deepspeed_command, run, runtime_env

RUNTIMES = ("upstream", "ours")
DEVICES = ("cpu", "nvme")


def offload_config(device: str, swap_dir: str) -> dict:
    from deepspeed_zero3.testing.engines import zero3_config

    param = {"device": device, "pin_memory": False}
    if device == "nvme":
        param.update(nvme_path=swap_dir, buffer_count=5, buffer_size=600_000, max_in_cpu=0)
    config = zero3_config(bucket=1_100_000, reuse=0, offload_param=param, offload_optimizer={"device": "cpu"})
    config["bf16"] = {"enabled": True}
    config["zero_force_ds_cpu_optimizer"] = False  # a client torch Adam: no JIT-built CPU Adam op
    return config


def worker(args) -> None:
    import torch
    import deepspeed

    from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine
    from deepspeed_zero3.testing.models import ResidualMLP

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    swap_dir = [tempfile.mkdtemp(prefix="zero3-offload-bench-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(swap_dir, src=0)
    torch.manual_seed(21)
    model = ResidualMLP(inp=16, width=1024, hidden=1024, blocks=2, out=4)
    engine = training_engine(model, offload_config(args.device, swap_dir[0]))
    wall, cpu, losses = [], [], []
    for step in range(args.warmup + args.steps):
        torch.distributed.barrier()
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        loss = mse_loss(engine(batch(step, rank).to(torch.bfloat16)).float())
        engine.backward(loss)
        engine.step()
        if step >= args.warmup:
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.thread_time() - start_cpu)
        losses.append(loss.item().hex())
    result = {"wall_s": wall, "cpu_s": cpu, "losses": losses}
    if "deepspeed_zero3" in type(engine.optimizer.parameter_offload).__module__:
        import deepspeed_zero3

        passes = deepspeed_zero3.get_zero3_stats(engine)["passes"]
        result["swap_ins"] = [{k: p[k] for k in ("kind", "swap_in_ahead", "swap_in_demand", "swap_in_unused")}
                              for p in passes[-2:]]
    engine.destroy()
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(swap_dir[0], ignore_errors=True)
        Path(args.out).write_text(json.dumps(result))
    os._exit(0)


def launch(runtime: str, device: str, args, out_dir: Path) -> dict:
    out, log = out_dir / f"{runtime}_{device}.json", out_dir / f"{runtime}_{device}.log"
    target = ["--module", "deepspeed_zero3.bench.offload", "--worker", "--device", device, "--out", out,
              "--steps", args.steps, "--warmup", args.warmup]
    launched = run(lambda port: deepspeed_command(2, port, target),
                   runtime_env(runtime, 2, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"), args.timeout, log=log)
    if launched.returncode != 0 or not out.exists():
        why = f"ran past --timeout {args.timeout}s" if launched.timed_out else f"failed (rc {launched.returncode})"
        raise SystemExit(f"offload bench: the {runtime} launch with offload_param.device={device} {why}; see {log}")
    return json.loads(out.read_text())


def table(results: dict) -> str:
    rows = []
    for device in DEVICES:
        up, ours = results["upstream", device], results["ours", device]
        med = {name: (statistics.median(r["wall_s"]) * 1e3, statistics.median(r["cpu_s"]) * 1e3)
               for name, r in (("up", up), ("ours", ours))}
        swaps = ", ".join(f"{p['kind']} {p['swap_in_ahead']}/{p['swap_in_demand']}/{p['swap_in_unused']}"
                          for p in ours.get("swap_ins", [])) if device == "nvme" else "-"
        rows.append((device, f"{med['up'][0]:.0f} / {med['up'][1]:.0f}", f"{med['ours'][0]:.0f} / {med['ours'][1]:.0f}",
                     f"{med['ours'][0] / med['up'][0]:.2f}, {med['ours'][1] / med['up'][1]:.2f}",
                     "yes" if up["losses"] == ours["losses"] else "NO", swaps))
    return markdown_table(("offload_param", "upstream wall / CPU per step (ms)", "ours wall / CPU per step (ms)",
                           "ours/upstream (wall, CPU)", "losses bitwise",
                           "ours swap-ins per steady pass (ahead, demand, unused)"), rows, align="lrrrll")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured training steps (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (default 2)")
    parser.add_argument("--out", default="bench-out/offload", help="folder for logs, JSON and offload.md")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=DEVICES, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)  # the launcher may add --local_rank=N
    if args.worker:
        worker(args)
        return
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():
        parser.error("NVMe offload needs DeepSpeed's async_io op: apt-get install libaio-dev, then make venv")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for device in DEVICES:
        for runtime in RUNTIMES:
            print(f"offload bench: {runtime}, offload_param.device={device} ...", file=sys.stderr, flush=True)
            results[runtime, device] = launch(runtime, device, args, out_dir)
    text = table(results)
    (out_dir / "offload.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
