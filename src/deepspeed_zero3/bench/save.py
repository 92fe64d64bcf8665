"""``python -m deepspeed_zero3.bench --save``: the 16-bit model to disk as users save it, upstream's way and ours.

A bf16 Llama built under ``deepspeed.zero.Init`` (no rank ever holds it whole), hidden 192, intermediate 768,
vocabulary 2,048, at ``--layers`` (default 48 and 96: 29.1M and 57.4M parameters), 2 CPU ranks over gloo, bucket
500,000:

* ``upstream``: ``engine.save_16bit_model(dir)`` under upstream's runtime (the kill switch): per module a
  ``GatheredParameters(modifier_rank=0)``, the whole state dict on rank 0, one ``pytorch_model.bin``;
* ``ours``: ``deepspeed_zero3.save_16bit_model(engine, dir, max_shard_size="4MB")`` under ours: safetensors shards
  split by huggingface_hub's rule, written through the weight stream.

One launch per method and size, so that each save starts from the same state. In each, every rank first gives its
C heap's free memory back (``malloc_trim``); during the first save a thread samples rank 0's resident set every 2 ms
(the peak rise, what is still above the start after the save, and after one more trim: memory only retained
free), and the collectives are counted: parameter all-gathers at the backend's gather function, broadcasts and
all_reduces at ``deepspeed.comm``. Then ``--repeats`` timed saves (median wall seconds, rank 0, between barriers).
Every tensor of ours must equal upstream's by name, bit for bit.
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

METHODS = ("upstream", "ours")
CONFIG = dict(vocab_size=2048, hidden_size=192, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64, tie_word_embeddings=False)
BUCKET = 500_000
SHARD = "4MB"
OTHER_COLLECTIVES = ("broadcast", "all_reduce")


def _counted(save) -> dict:
    """Run ``save``, counting parameter all-gathers at the backend and the other collectives at ``deepspeed.comm``."""
    from deepspeed import comm as ds_comm

    from deepspeed_zero3.testing.collectives import parameter_gathers

    counts = dict.fromkeys(OTHER_COLLECTIVES, 0)
    saved = []
    for name in OTHER_COLLECTIVES:
        original = getattr(ds_comm, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        saved.append((name, original))
        setattr(ds_comm, name, wrapped)
    try:
        with parameter_gathers() as gathers:
            save()
    finally:
        for name, original in saved:
            setattr(ds_comm, name, original)
    return {"all_gathers": gathers["calls"], "broadcasts": counts["broadcast"], "all_reduces": counts["all_reduce"]}


def worker(method: str, layers: int, repeats: int, save_dir: str, result: str) -> int:
    import threading

    import torch
    import torch._dynamo  # noqa: F401  (imported before zero.Init patches torch.Tensor.__new__)

    import deepspeed
    import deepspeed_zero3
    from deepspeed_zero3.bench.runtime import runtime_name
    from deepspeed_zero3.heap_trim import _malloc_trim
    from deepspeed_zero3.testing.models import llama_from_config

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": BUCKET,
                                    "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "steps_per_print": 10**9}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = llama_from_config(num_hidden_layers=layers, **CONFIG)
    # upstream's save needs the engine's checkpoint engine, which comes with an optimizer
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=0.0))

    def save():
        if method == "ours":
            return deepspeed_zero3.save_16bit_model(engine, save_dir, max_shard_size=SHARD)
        assert engine.save_16bit_model(save_dir) is True
        return ["pytorch_model.bin"]

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
    box = {}
    counts = _counted(lambda: box.update(files=save()))
    done[0] = True
    watcher.join()
    after = resident_mb()
    trim(0)
    after_trim = resident_mb()
    walls = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        save()
        torch.distributed.barrier()
        walls.append(time.perf_counter() - start)
    if rank == 0:
        row = {"method": method, "runtime": runtime_name(), "layers": layers,
               "parameters": sum(p.ds_numel for p in model.parameters()),
               "tensors": len(list(model.parameters())), "bucket": BUCKET,
               "shard": SHARD if method == "ours" else "one file",
               "before_mb": round(before, 1), "peak_rise_mb": round(max(peak[0], after) - before, 1),
               "retained_mb": round(after - before, 1), "after_trim_mb": round(after_trim - before, 1),
               "wall_s": round(statistics.median(walls), 3), "wall_s_runs": [round(w, 3) for w in walls],
               "files": len([name for name in box["files"] if not name.endswith(".json")]), **counts,
               "torch": torch.__version__, "deepspeed": deepspeed.__version__}
        Path(result).write_text(json.dumps(row))
    torch.distributed.barrier()
    engine.destroy()
    return 0


# ---------------------------------------------------------------------------------------------- driver


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


def equal_by_name(ours_dir: str, upstream_dir: str) -> bool:
    """The same names, and each tensor of the same dtype and bits."""
    import torch

    ours, upstream = _read(ours_dir), _read(upstream_dir)
    return bool(ours) and set(ours) == set(upstream) and all(
        ours[name].dtype == upstream[name].dtype and torch.equal(ours[name], upstream[name]) for name in ours)


def table(rows) -> str:
    from deepspeed_zero3.bench.tables import markdown_table

    upstream = {row["layers"]: row for row in rows if row["method"] == "upstream"}
    cells = []
    for row in rows:
        base = upstream.get(row["layers"])
        cells.append([row["method"], row["layers"], f"{row['parameters']:,}", f"{row['wall_s']:.3f}",
                      f"{row['wall_s'] / base['wall_s']:.2f}" if base else "-", row["all_gathers"], row["broadcasts"],
                      row["all_reduces"], f"{row['peak_rise_mb']:.1f}", f"{row['retained_mb']:.1f}",
                      f"{row['after_trim_mb']:.1f}", row["files"],
                      {True: "yes", False: "NO"}.get(row.get("equal"), "-")])
    return markdown_table(["method", "layers", "parameters", "wall s (median)", "/ upstream", "all-gathers",
                           "broadcasts", "all_reduces", "rank 0 peak rise, MB", "above the start after, MB",
                           "after a trim, MB", "files", "equal to upstream"], cells, align="lrrrrrrrrrrrl") + "\n"


def main(args) -> int:
    import datetime

    from deepspeed_zero3.bench.runtime import source_commit
    from deepspeed_zero3.testing import launching

    out = Path(args.out) / "save"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="zero3-bench-save-") as scratch:
        for layers in args.layers:
            dirs = {}
            for method in METHODS:
                dirs[method] = os.path.join(scratch, f"{method}-{layers}")
                raw = Path(scratch) / f"{method}-{layers}.json"
                log = out / "logs" / f"{method}-{layers}.log"
                print(f"save: {method}, {layers} layers, 1 + {args.repeats} saves (log {log})", file=sys.stderr,
                      flush=True)
                launched = launching.run(
                    lambda port, method=method, raw=raw: launching.deepspeed_command(
                        2, port, ["--no_local_rank", "--module", "deepspeed_zero3.bench.save", "--worker", method,
                                  str(layers), str(args.repeats), dirs[method], str(raw)]),
                    launching.runtime_env(method, 2, DS_ACCELERATOR="cpu"), args.timeout, log=log)
                if launched.returncode != 0 or not raw.exists():
                    print(f"FAILED: save launch ({method}, {layers} layers) exit {launched.returncode}; log {log}",
                          file=sys.stderr)
                    failed = True
                    continue
                rows.append(json.loads(raw.read_text()))
            if all(os.path.isdir(d) for d in dirs.values()):
                equal = equal_by_name(dirs["ours"], dirs["upstream"])
                rows[-1]["equal"] = equal
                failed = failed or not equal
            for directory in dirs.values():  # two copies of the model at a time, at most
                shutil.rmtree(directory, ignore_errors=True)
    text = table(rows)
    results = {"command": "python -m deepspeed_zero3.bench --save --repeats "
                          f"{args.repeats} --layers {','.join(map(str, args.layers))}",
               "commit": source_commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "cpu_count": os.cpu_count(), "wall_seconds": round(time.time() - started, 1), "rows": rows}
    (out / "save.md").write_text(text)
    (out / "save.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return 1 if failed else 0


def add_arguments(parser) -> None:
    def layer_list(text: str):
        try:
            values = [int(n) for n in text.split(",") if n.strip()]
        except ValueError:
            values = []
        if not values or any(n < 1 for n in values):
            raise argparse.ArgumentTypeError(f"--layers {text!r}: expected positive integers separated by commas, "
                                             f"e.g. 48,96")
        return values

    parser.add_argument("--layers", type=layer_list, default=[48, 96],
                        help="--save: the Llama's sizes, in layers (default 48,96)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        method, layers, repeats, save_dir, result = sys.argv[at + 1:at + 6]
        code = worker(method, int(layers), int(repeats), save_dir, result)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
