"""``python -m deepspeed_zero3.bench --save``: the full 16-bit model to disk, upstream's way and ours.

On 2 ranks, a bf16 TinyGPT of 48 blocks (29.7M parameters, 59 MB in bf16) under our runtime, bucket 2,000,000:

* ``upstream``: ``engine.save_16bit_model(dir)`` (``stage3_gather_16bit_weights_on_model_save``), upstream's engine
  code: per module a ``GatheredParameters(modifier_rank=0)``, the whole state dict on rank 0, one ``torch.save``;
* ``ours``: ``deepspeed_zero3.save_16bit_model(engine, dir)``, one safetensors file written through the stream;
* ``ours, .bin``: the same with ``safe_serialization=False`` (the whole shard held, as torch.save needs it).

One launch per method, so that rank 0's resident-memory high-water mark (``ru_maxrss``) rises from the same
start; in each, ``--repeats`` timed saves (median wall seconds, rank 0, between barriers). Collectives are counted
at ``deepspeed.comm`` for one save: all-gathers, broadcasts and all_reduces (ours: one per bucket, [Note: a stream
stops together]). Every file's tensors must equal upstream's by name, bit for bit.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("upstream", "ours", "ours, .bin")
MODEL = dict(vocab=2048, dim=224, heads=4, layers=48, max_seq=64)
BUCKET = 2_000_000
COLLECTIVES = ("all_gather_into_tensor", "allgather_fn", "all_gather", "broadcast", "all_reduce")


def _save(method: str, engine, save_dir: str) -> None:
    import deepspeed_zero3

    if method == "upstream":
        assert engine.save_16bit_model(save_dir) is True
    else:
        deepspeed_zero3.save_16bit_model(engine, save_dir, safe_serialization=(method == "ours"))


def _counted(save):
    """Run ``save`` with every collective of ``deepspeed.comm`` counted, by kind."""
    from deepspeed import comm as ds_comm

    counts = {name: 0 for name in COLLECTIVES}
    saved = []
    for name in COLLECTIVES:
        original = getattr(ds_comm, name, None)
        if original is None:
            continue

        def wrapped(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        saved.append((name, original))
        setattr(ds_comm, name, wrapped)
    try:
        save()
    finally:
        for name, original in saved:
            setattr(ds_comm, name, original)
    return {"all-gathers": counts["all_gather_into_tensor"] + counts["allgather_fn"] + counts["all_gather"],
            "broadcasts": counts["broadcast"], "all_reduces": counts["all_reduce"]}


def _read(save_dir: str) -> dict:
    import torch

    from deepspeed_zero3.safetensors_file import read_safetensors

    tensors = {}
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name.endswith(".safetensors"):
            tensors.update(read_safetensors(path))
        elif name.endswith(".bin"):
            tensors.update(torch.load(path, weights_only=True))
    return tensors


def worker(argv) -> None:
    import datetime

    import torch

    import deepspeed
    from deepspeed_zero3.testing.engines import training_engine, zero3_config
    from deepspeed_zero3.testing.models import TinyGPT

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args, _ = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    rank = torch.distributed.get_rank()
    torch.manual_seed(7)
    config = zero3_config(bucket=BUCKET, reuse=0, stage3_gather_16bit_weights_on_model_save=True)
    config["bf16"] = {"enabled": True}
    model = TinyGPT(**MODEL).to(torch.bfloat16)
    engine = training_engine(model, config)  # upstream's save needs the engine's checkpoint engine: an optimizer
    save_dir = os.path.join(args.dir, args.method.replace(", ", "-").replace(".", ""))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts = _counted(lambda: _save(args.method, engine, save_dir))
    rss_rise_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    walls = []
    for _ in range(args.repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        _save(args.method, engine, save_dir)
        torch.distributed.barrier()
        walls.append(time.perf_counter() - start)
    if rank == 0:
        result = {"seconds": statistics.median(walls), "seconds_runs": walls, "rss_rise_mb": rss_rise_mb,
                  "files": sorted(os.listdir(save_dir)), "numel": sum(p.ds_numel for p in model.parameters()),
                  "tensors": len(list(model.parameters())), **counts}
        Path(args.out).write_text(json.dumps(result, indent=1))
    torch.distributed.barrier()
    engine.destroy()


# ---------------------------------------------------------------------------------------------- driver


def compare(results: dict, save_dirs: dict) -> bool:
    """Every method's tensors equal upstream's by name, bit for bit (the tied or duplicate names aside)."""
    import torch

    upstream = _read(save_dirs["upstream"])
    for method in METHODS[1:]:
        ours = _read(save_dirs[method])
        results[method]["equal"] = bool(ours) and all(
            name in upstream and ours[name].dtype == upstream[name].dtype and torch.equal(ours[name], upstream[name])
            for name in ours) and set(upstream) - set(ours) <= {"lm_head.weight"}
    results["upstream"]["equal"] = True
    return all(results[m]["equal"] for m in METHODS)


def table(results: dict) -> str:
    from deepspeed_zero3.bench.tables import markdown_table

    base = results["upstream"]["seconds"]
    rows = [[method, f"{side['seconds']:.3f}", f"{side['seconds'] / base:.2f}", side["all-gathers"],
             side["broadcasts"], side["all_reduces"], f"{side['rss_rise_mb']:.0f}", ", ".join(side["files"]),
             "yes" if side.get("equal") else "NO"] for method, side in results.items() if method in METHODS]
    return markdown_table(["method", "wall s (median)", "/ upstream", "all-gathers", "broadcasts", "all_reduces",
                           "rank 0 RSS rise, MB", "files", "equal to upstream"], rows, align="lrrrrrrll")


def main(args) -> int:
    from deepspeed_zero3.testing import launching

    out = Path(args.out) / "save"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results, failed = {}, False
    with tempfile.TemporaryDirectory() as scratch:
        save_dirs = {m: os.path.join(scratch, m.replace(", ", "-").replace(".", "")) for m in METHODS}
        for method in METHODS:
            raw = out / f"{method.replace(', ', '-').replace('.', '')}.json"
            raw.unlink(missing_ok=True)
            log = out / "logs" / f"{raw.stem}.log"
            print(f"save: {method}, {args.repeats} repeats (log {log})", file=sys.stderr, flush=True)
            launched = launching.run(
                lambda port, method=method, raw=raw: launching.deepspeed_command(
                    2, port, ["--module", "deepspeed_zero3.bench.save", "--worker", "--out", str(raw), "--method",
                              method, "--repeats", str(args.repeats), "--dir", scratch]),
                launching.runtime_env("ours", 2), args.timeout, log=log)
            if launched.returncode != 0 or not raw.exists():
                print(f"FAILED: save launch ({method}) exit {launched.returncode}; log {log}", file=sys.stderr)
                failed = True
                continue
            results[method] = json.loads(raw.read_text())
        if not failed:
            failed = not compare(results, save_dirs)
    if "upstream" in results:
        text = table(results)
        (out / "save.md").write_text(text + "\n")
        (out / "save.json").write_text(json.dumps(results, indent=1))
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
