"""``python -m deepspeed_zero3.bench --export``: copying the full weights out of a ZeRO-3 model, three ways.

On 2 ranks, for Model B (199,876 parameters, 14 tensors) and 2,000 ``Linear(8, 8)`` (144,000 parameters, 4,000
tensors), each trained one step with bucket 20,000 under our runtime, every rank copies every full parameter into
a preallocated plain copy of the model (the same work per tensor for every method):

* ``per-parameter``: one ``GatheredParameters([p])`` per parameter, as weight syncs commonly do;
* ``whole model``: one ``GatheredParameters`` over every parameter;
* ``iterator``: ``deepspeed_zero3.iter_gathered_parameters(engine)`` (the engine's bucket, the next in flight);
  and with ``bucket_numel=100_000``: fewer, larger collectives for twice the peak.

Reported per model and method: median wall seconds over ``--repeats`` runs (rank 0, between barriers), all-gathers
counted at ``deepspeed.comm``, and the peak gathered numel (AVAILABLE non-persistent numel, read after each copy in
a separate probe run so that reading it costs the timed runs nothing). Every copy must equal the per-parameter one.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

METHODS = ("per-parameter", "whole model", "iterator", "iterator, bucket 100,000")
MODELS = ("Model B", "2,000 x Linear(8, 8)")
BUCKET = 20_000


def _model(name: str):
    import torch

    from deepspeed_zero3.testing.models import model_b

    torch.manual_seed(51)
    if name == "Model B":
        return model_b()
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(2000)))


def _copy_out(method: str, engine, model, destination, probe=None):
    import deepspeed
    import deepspeed_zero3

    named = list(model.named_parameters())
    if method == "per-parameter":
        for name, param in named:
            with deepspeed.zero.GatheredParameters([param]):
                destination[name].copy_(param.detach())
                if probe:
                    probe()
    elif method == "whole model":
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            for name, param in named:
                destination[name].copy_(param.detach())
                if probe:
                    probe()
    else:
        bucket = 100_000 if method.endswith("100,000") else None
        for name, tensor in deepspeed_zero3.iter_gathered_parameters(engine, bucket_numel=bucket):
            destination[name].copy_(tensor)
            if probe:
                probe()


def _measure(model_name: str, repeats: int) -> dict:
    import torch

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
    from deepspeed_zero3.testing.instrument import GatherMeter

    model = _model(model_name)
    engine = training_engine(model, zero3_config(bucket=BUCKET, reuse=0))
    width = 16 if model_name == "Model B" else 8
    train_step(engine, batch(0, torch.distributed.get_rank(), shape=(4, width)))
    destination = {name: torch.empty(tuple(p.ds_shape), dtype=p.dtype) for name, p in model.named_parameters()}
    reference = None
    results = {}
    try:
        for method in METHODS:
            tracked = [p for p in model.parameters() if not p.ds_persist]
            peak = [0]

            def probe():
                live = sum(p.ds_numel for p in tracked if p.ds_status != ZeroParamStatus.NOT_AVAILABLE)
                peak[0] = max(peak[0], live)

            _copy_out(method, engine, model, destination, probe)
            copied = {name: value.clone() for name, value in destination.items()}
            if reference is None:
                reference = copied
            equal = all(torch.equal(copied[n], reference[n]) for n in reference)
            walls = []
            with GatherMeter(model) as meter:
                for _ in range(repeats):
                    with meter.phase("export"):
                        torch.distributed.barrier()
                        start = time.perf_counter()
                        _copy_out(method, engine, model, destination)
                        torch.distributed.barrier()
                        walls.append(time.perf_counter() - start)
            counts = meter.snapshot()["export"]
            results[method] = {"seconds": statistics.median(walls), "seconds_runs": walls,
                               "allgathers": counts["allgather_calls"] // repeats,
                               "gathered_numel": counts["allgather_numel"] // repeats,
                               "peak_gathered_numel": peak[0], "equal": equal}
    finally:
        engine.destroy()
    results["_model"] = {"numel": sum(p.ds_numel for p in model.parameters()),
                         "tensors": len(list(model.parameters())),
                         "largest": max(p.ds_numel for p in model.parameters()), "bucket": BUCKET}
    return results


def worker(argv) -> None:
    import datetime

    import torch

    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    results = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "models": {}}
    for name in MODELS:
        results["models"][name] = _measure(name, args.repeats)
        if torch.distributed.get_rank() == 0:
            Path(args.out).write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------- driver


def table(results: dict) -> str:
    from deepspeed_zero3.bench.tables import markdown_table

    rows = []
    for model_name in MODELS:
        entry = results.get("models", {}).get(model_name)
        if not entry:
            continue
        per_param, whole = entry["per-parameter"]["seconds"], entry["whole model"]["seconds"]
        for method in METHODS:
            side = entry[method]
            rows.append([model_name, method, f"{side['seconds'] * 1000:.1f}", f"{side['seconds'] / per_param:.2f}",
                         f"{side['seconds'] / whole:.2f}", side["allgathers"], f"{side['peak_gathered_numel']:,}",
                         "yes" if side["equal"] else "NO"])
    return markdown_table(["model", "method", "wall ms (median)", "/ per-parameter", "/ whole model", "all-gathers",
                           "peak gathered numel", "values equal"], rows, align="llrrrrrl")


def plot(results: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(9, 3.6))
    colors = {"per-parameter": "tab:red", "whole model": "tab:orange", "iterator": "tab:blue",
              "iterator, bucket 100,000": "tab:cyan"}
    for ax, model_name in zip(axes, MODELS):
        entry = results.get("models", {}).get(model_name, {})
        for method in METHODS:
            if method not in entry:
                continue
            side = entry[method]
            ax.scatter(side["peak_gathered_numel"] / entry["_model"]["numel"], side["seconds"] * 1000,
                       color=colors[method], s=50, label=method)
        ax.set_xscale("log")
        ax.set_xlabel("peak gathered, fraction of the model (log)")
        ax.set_ylabel("wall ms per export (median)")
        ax.set_title(model_name, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Copying full weights out of a ZeRO-3 model, 2 ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> int:
    from deepspeed_zero3.testing import launching

    out = Path(args.out) / "export"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    raw = out / "ours.json"
    raw.unlink(missing_ok=True)
    print(f"export: one launch (ours), {len(MODELS)} models x {len(METHODS)} methods x {args.repeats} repeats "
          f"(log {out / 'logs' / 'ours.log'})", file=sys.stderr, flush=True)
    launched = launching.run(
        lambda port: launching.deepspeed_command(2, port, ["--module", "deepspeed_zero3.bench.export", "--worker",
                                                           "--out", str(raw), "--repeats", str(args.repeats)]),
        launching.runtime_env("ours", 2), args.timeout, log=out / "logs" / "ours.log")
    results = json.loads(raw.read_text()) if raw.exists() else {}
    text = table(results)
    (out / "export.md").write_text(text + "\n")
    (out / "export.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, out / "export.png")
    except ImportError as exc:
        print(f"plot skipped: {exc}", file=sys.stderr)
    print(text)
    failed = launched.returncode != 0 or not raw.exists() or any(
        not side["equal"] for entry in results.get("models", {}).values() for m, side in entry.items() if m in METHODS)
    if failed:
        print(f"FAILED: export launch exit {launched.returncode}; log {out / 'logs' / 'ours.log'}", file=sys.stderr)
    return 1 if failed else 0


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=5, help="--export: timed runs per method (default 5)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
        # Out at once, as the parity scenarios leave: the results are written, and an interpreter shutdown with
        # gloo's threads still up sometimes aborts ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
