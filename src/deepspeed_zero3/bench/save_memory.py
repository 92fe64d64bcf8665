"""Rank 0's resident memory while the 16-bit model is saved, ours against upstream's, at two model sizes.

    python -m deepspeed_zero3.bench.save_memory [--layers 48,96] [--out docs/results]

A bf16 Llama built under ``deepspeed.zero.Init`` (no rank ever holds it whole), hidden 192, intermediate 768,
vocabulary 2,048, 48 and 96 layers (29.1M and 57.4M parameters), 2 ranks, bucket 500,000, saved in 4 MB shards
(ours: ``deepspeed_zero3.save_16bit_model``; upstream: ``engine.save_16bit_model``, its engine's own code, which
gathers with ``GatheredParameters`` whichever runtime serves the hooks, into one file). One launch per method and
size. Before the save each rank gives its C heap's free memory back (``malloc_trim``), so each save
starts from the same state; a thread samples rank 0's resident set every 2 ms during it. Written: the peak rise,
the resident set after the save and after a trim (what was only retained free memory), the wall time and the files.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

METHODS = ("upstream", "ours")
CONFIG = dict(vocab_size=2048, hidden_size=192, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64, tie_word_embeddings=False)
BUCKET = 500_000
SHARD = "4MB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_zero3.bench.save_memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="48,96", help="model sizes, in layers (default 48,96)")
    parser.add_argument("--out", default="docs/results", help="folder for save_memory.json and .md")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "LAYERS", "RESULT"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        return worker(*args.worker)
    from deepspeed_zero3.testing import launching

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for layers in [int(n) for n in args.layers.split(",")]:
            for method in METHODS:
                result = Path(scratch) / f"{method}-{layers}.json"
                launched = launching.run(
                    lambda port: launching.deepspeed_command(2, port, ["--no_local_rank", "--module",
                                                                       "deepspeed_zero3.bench.save_memory", "--worker",
                                                                       method, str(layers), str(result)]),
                    launching.runtime_env("ours", 2, DS_ACCELERATOR="cpu"), 900, log=Path(scratch) / "log.txt")
                if launched.returncode != 0:
                    print((Path(scratch) / "log.txt").read_text()[-4000:], file=sys.stderr)
                    return 1
                rows.append(json.loads(result.read_text()))
                print(format_row(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "save_memory.json").write_text(json.dumps({"command": "python -m deepspeed_zero3.bench.save_memory "
                                                      f"--layers {args.layers}", "rows": rows}, indent=2) + "\n")
    (out / "save_memory.md").write_text(table(rows))
    return 0


def format_row(row: dict) -> str:
    return (f"{row['method']:8s} {row['layers']:3d} layers ({row['parameters']:,} parameters): peak rise "
            f"{row['peak_rise_mb']:.1f} MB, retained after {row['after_mb'] - row['before_mb']:.1f} MB, after a trim "
            f"{row['after_trim_mb'] - row['before_mb']:.1f} MB, {row['wall_s']:.2f} s, {row['files']} file(s)")


def table(rows) -> str:
    lines = ["| method | layers | parameters | peak rise, MB | above the start after the save, MB | after a trim, MB "
             "| wall, s | files |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['layers']} | {row['parameters']:,} | {row['peak_rise_mb']:.1f} | "
                     f"{row['after_mb'] - row['before_mb']:.1f} | {row['after_trim_mb'] - row['before_mb']:.1f} | "
                     f"{row['wall_s']:.2f} | {row['files']} |")
    return "\n".join(lines) + "\n"


def worker(method: str, layers: str, result: str) -> int:
    import shutil
    import threading
    import time

    import torch
    import torch._dynamo  # noqa: F401  (imported before zero.Init patches torch.Tensor.__new__)

    import deepspeed
    import deepspeed_zero3
    from deepspeed_zero3.bench.runtime import runtime_name
    from deepspeed_zero3.heap_trim import _malloc_trim
    from deepspeed_zero3.testing.models import llama_from_config

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": BUCKET,
                                    "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "steps_per_print": 10**9}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = llama_from_config(num_hidden_layers=int(layers), **CONFIG)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=0.0))
    box = [tempfile.mkdtemp(prefix="zero3-save-memory-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)

    def resident_mb() -> float:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    trim = _malloc_trim() or (lambda _pad: 0)
    trim(0)
    torch.distributed.barrier()
    before, peak, done = resident_mb(), [0.0], [False]

    def watch():
        while not done[0]:
            peak[0] = max(peak[0], resident_mb())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    if method == "ours":
        files = deepspeed_zero3.save_16bit_model(engine, box[0], max_shard_size=SHARD)
    else:
        assert engine.save_16bit_model(box[0]) is True
        files = ["pytorch_model.bin"]
    wall = time.perf_counter() - start
    done[0] = True
    watcher.join()
    after = resident_mb()
    trim(0)
    if rank == 0:
        row = {"method": method, "runtime": runtime_name(), "layers": int(layers),
               "parameters": sum(p.ds_numel for p in model.parameters()), "bucket": BUCKET, "shard": SHARD,
               "before_mb": round(before, 1), "peak_rise_mb": round(max(peak[0], after) - before, 1),
               "after_mb": round(after, 1), "after_trim_mb": round(resident_mb(), 1), "wall_s": round(wall, 3),
               "files": len([name for name in files if not name.endswith(".json")]),
               "torch": torch.__version__, "deepspeed": deepspeed.__version__}
        Path(result).write_text(json.dumps(row))
        shutil.rmtree(box[0], ignore_errors=True)
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
