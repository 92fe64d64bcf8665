"""``python -m deepspeed_zero3.bench --sync``: a ZeRO-3 model's weights to a receiver in another process, four ways.

The bf16 Llama of ``--save`` (built under ``deepspeed.zero.Init``, hidden 192, 48 layers, 29.1M parameters, 435
tensors) on 2 CPU trainer ranks over gloo, bucket 500,000, under our runtime. Trainer rank 0 starts a receiver
process holding a plain copy of the model; trainer rank 0 and the receiver share a gloo group of two built from a TCP
store, as RL stacks build theirs, and all three share a second one for the shards. One sync, each way:

* ``sender``: ``deepspeed_zero3.WeightSender(engine, group).send()`` on the trainer ranks,
  ``receive_weights(group, model)`` on the receiver: metadata, then one flat buffer per bucket, the next bucket's
  all-gather in flight while rank 0 sends;
* ``per parameter``: one ``GatheredParameters([p])`` and one broadcast per tensor, as syncs are commonly written;
* ``sender, bucket 4,000,000``: the same with ``WeightSender(..., bucket_numel=4_000_000)``: fewer, larger
  collectives for a higher peak;
* ``raw broadcast``: one broadcast of the same bytes from a buffer built beforehand: the wire bound of sending the
  whole model from one rank;
* ``raw all-gather, then broadcast``: one all-gather of the same bytes between the trainer ranks, then that
  broadcast, from buffers built beforehand: the wire bound of any sync that first gathers a ZeRO-3 model to one rank;
* ``local shards``: no all-gather; each trainer rank packs its partitions (``iter_local_shards``) into one buffer and
  sends it to the receiver (point to point), which puts every piece at its offset.

Each sync ends when the receiver has copied everything and answered (one element back), and every trainer rank has
passed a barrier: wall seconds on trainer rank 0, median of ``--repeats`` rounds, the methods interleaved within a
round. Before the timed rounds, one sync of each content-bearing way is checked: the receiver sends its weights back
and they must equal the trainer's, bit for bit; in those checks the gathered numel (AVAILABLE or INFLIGHT, not
persistent) is read before every send: the peak.
"""

import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

BIG_BUCKET = 4_000_000
METHODS = ("sender", f"sender, bucket {BIG_BUCKET:,}", "per parameter", "raw broadcast", "raw all-gather, then broadcast",
           "local shards")
CHECKED = ("sender", f"sender, bucket {BIG_BUCKET:,}", "per parameter", "local shards")
RAW = ("raw broadcast", "raw all-gather, then broadcast")
LAYERS = 48
TIMEOUT = datetime.timedelta(seconds=300)


def _group(port: int, rank: int, size: int):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(store, rank, size, TIMEOUT)


def _broadcast(group, tensor, root: int) -> None:
    from deepspeed_zero3.sender import _broadcast as broadcast
    broadcast(group, tensor, root)


def _model():
    import torch

    from deepspeed_zero3.bench.save import CONFIG
    from deepspeed_zero3.testing.models import llama_from_config

    return llama_from_config(num_hidden_layers=LAYERS, **CONFIG).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------- the receiver


def _receiver(port2: int, port3: int, repeats: int) -> None:
    import torch

    import deepspeed_zero3
    from deepspeed_zero3.sender import _receive_object

    torch.set_num_threads(1)
    torch.manual_seed(1)  # other weights than the trainer's: only a sync makes them equal
    model = _model()
    params = dict(model.named_parameters())
    numel = sum(p.numel() for p in params.values())
    pair, trio = _group(port2, 1, 2), _group(port3, 2, 3)
    layouts = [_receive_object(trio, src) for src in (0, 1)]
    raw = torch.empty(numel, dtype=torch.bfloat16)

    def receive(method):
        with torch.no_grad():
            if method.startswith("sender"):
                deepspeed_zero3.receive_weights(pair, model)
            elif method == "per parameter":
                for param in params.values():
                    _broadcast(pair, param.data, 0)
            elif method in RAW:
                _broadcast(pair, raw, 0)
            else:
                for src, layout in enumerate(layouts):
                    packed = torch.empty(sum(n for _, _, n in layout), dtype=torch.bfloat16)
                    trio.recv([packed], src, 0).wait()
                    at = 0
                    for name, offset, count in layout:
                        params[name].data.view(-1)[offset:offset + count].copy_(packed[at:at + count])
                        at += count

    for method in CHECKED:
        with torch.no_grad():
            for param in params.values():  # scrambled, so that each check sees only what its way sent
                param.data.fill_(float("nan"))
        receive(method)
        _broadcast(pair, torch.cat([p.data.reshape(-1) for p in params.values()]), 1)
    for _ in range(repeats):
        for method in METHODS:
            receive(method)
            _broadcast(pair, torch.ones(1), 1)


# ---------------------------------------------------------------------------------------------- the trainers


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(repeats: int, result: str) -> int:
    import multiprocessing

    import torch
    import torch._dynamo  # noqa: F401  (imported before zero.Init patches torch.Tensor.__new__)
    import torch.distributed as dist

    import deepspeed
    import deepspeed_zero3
    import deepspeed_zero3.sender as sender_module
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed_zero3.bench.save import BUCKET
    from deepspeed_zero3.sender import _send_object
    from deepspeed_zero3.testing.collectives import parameter_gathers

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": BUCKET,
                                    "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10**9}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = _model()
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=0.0))
    named = list(model.named_parameters())
    numel = sum(p.ds_numel for _, p in named)
    ports = [_free_port(), _free_port()] if rank == 0 else [None, None]
    dist.broadcast_object_list(ports, src=0)
    child = None
    if rank == 0:
        child = multiprocessing.get_context("spawn").Process(target=_receiver, args=(*ports, repeats))
        child.start()
    pair = _group(ports[0], 0, 2) if rank == 0 else None
    trio = _group(ports[1], rank, 3)
    layout = [(s.name, s.offset, s.tensor.numel()) for s in deepspeed_zero3.iter_local_shards(engine)]
    for src in (0, 1):
        if src == rank:
            _send_object(trio, layout, src)
        else:  # the layouts go to every member; a trainer rank takes the other's and drops it
            sender_module._receive_object(trio, src)
    reference = torch.cat([t.reshape(-1).clone() for _, t in deepspeed_zero3.iter_gathered_parameters(engine)])
    sender = deepspeed_zero3.WeightSender(engine, pair)
    big_sender = deepspeed_zero3.WeightSender(engine, pair, bucket_numel=BIG_BUCKET)
    raw = torch.zeros(numel, dtype=torch.bfloat16) if rank == 0 else None
    half, full = torch.zeros(-(-numel // 2), dtype=torch.bfloat16), torch.zeros(-(-numel // 2) * 2, dtype=torch.bfloat16)

    def gather_then_broadcast():
        dist.all_gather_into_tensor(full, half)
        if pair is not None:
            _broadcast(pair, full[:numel], 0)

    def per_parameter(probe=None):
        for _, param in named:
            with deepspeed.zero.GatheredParameters([param]):
                if probe:
                    probe()
                if pair is not None:
                    _broadcast(pair, param.data, 0)

    def local_shards():
        packed = torch.cat([s.tensor.reshape(-1) for s in deepspeed_zero3.iter_local_shards(engine)])
        trio.send([packed], 2, 0).wait()

    ways = {"sender": sender.send, f"sender, bucket {BIG_BUCKET:,}": big_sender.send, "per parameter": per_parameter,
            "raw broadcast": lambda: pair is not None and _broadcast(pair, raw, 0),
            "raw all-gather, then broadcast": gather_then_broadcast, "local shards": local_shards}
    results = {method: {} for method in METHODS}
    tracked = [p for _, p in named if not p.ds_persist]
    for method in CHECKED:
        peak = [0]

        def probe():
            live = sum(p.ds_numel for p in tracked if p.ds_status != ZeroParamStatus.NOT_AVAILABLE)
            peak[0] = max(peak[0], live)

        original = sender_module._broadcast
        if method.startswith("sender"):
            sender_module._broadcast = lambda *args: (probe(), original(*args))
        try:
            with parameter_gathers() as gathers:
                per_parameter(probe) if method == "per parameter" else ways[method]()
        finally:
            sender_module._broadcast = original
        if rank == 0:
            back = torch.empty(numel, dtype=torch.bfloat16)
            _broadcast(pair, back, 1)
            results[method].update(equal=bool(torch.equal(back, reference)), peak_gathered_numel=peak[0],
                                   all_gathers=gathers["calls"])
        dist.barrier()
    results["raw broadcast"].update(equal=None, peak_gathered_numel=0, all_gathers=0)
    results["raw all-gather, then broadcast"].update(equal=None, peak_gathered_numel=0, all_gathers=1)
    walls = {method: [] for method in METHODS}
    for _ in range(repeats):
        for method in METHODS:
            dist.barrier()
            start = time.perf_counter()
            ways[method]()
            if rank == 0:
                _broadcast(pair, torch.empty(1), 1)
            dist.barrier()
            walls[method].append(time.perf_counter() - start)
    if rank == 0:
        child.join(timeout=120)
        for method in METHODS:
            results[method].update(wall_s=statistics.median(walls[method]), wall_s_runs=walls[method])
        Path(result).write_text(json.dumps({
            "model": {"layers": LAYERS, "parameters": numel, "tensors": len(named), "bucket": BUCKET,
                      "largest": max(p.ds_numel for _, p in named), "bytes": numel * 2},
            "bytes_per_trainer_rank": {"local shards": sum(n for _, _, n in layout) * 2},
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "methods": results}))
    dist.barrier()
    engine.destroy()
    return 0 if rank != 0 or child.exitcode == 0 else 1


# ---------------------------------------------------------------------------------------------- driver


def tables(results: dict) -> str:
    from deepspeed_zero3.bench.tables import markdown_table

    methods, model = results["methods"], results["model"]
    per_param, wire = methods["per parameter"]["wall_s"], methods["raw broadcast"]["wall_s"]
    gathered_wire = methods["raw all-gather, then broadcast"]["wall_s"]
    bound = 2 * model["bucket"] + model["largest"]

    def row(method):
        side = methods[method]
        return [method, f"{side['wall_s'] * 1000:.0f}", f"{side['wall_s'] / per_param:.2f}",
                f"{side['wall_s'] / wire:.2f}", f"{side['wall_s'] / gathered_wire:.2f}", side["all_gathers"], f"{side['peak_gathered_numel']:,}",
                {True: "yes", False: "NO", None: "-"}[side["equal"]]]

    header = ["method", "wall ms (median)", "/ per parameter", "/ raw broadcast", "/ raw all-gather + broadcast",
              "all-gathers",
              "peak gathered numel", "receiver bitwise equal"]
    return (f"Sync ({model['parameters']:,} parameters, {model['tensors']} tensors, bf16; 2 buckets + the largest "
            f"tensor = {bound:,}):\n\n"
            + markdown_table(header, [row(m) for m in METHODS[:-1]], "lrrrrrrl")
            + f"\n\nLocal shards ({results['bytes_per_trainer_rank']['local shards']:,} bytes from each trainer "
            f"rank):\n\n" + markdown_table(header, [row("local shards")], "lrrrrrrl") + "\n")


def main(args) -> int:
    from deepspeed_zero3.bench.runtime import source_commit
    from deepspeed_zero3.testing import launching

    out = Path(args.out) / "sync"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    raw, log = out / "raw.json", out / "logs" / "ours.log"
    raw.unlink(missing_ok=True)
    started = time.time()
    print(f"sync: one launch (ours), {len(METHODS)} ways x {args.repeats} rounds (log {log})", file=sys.stderr,
          flush=True)
    launched = launching.run(
        lambda port: launching.deepspeed_command(2, port, ["--no_local_rank", "--module", "deepspeed_zero3.bench.sync",
                                                           "--worker", str(args.repeats), str(raw)]),
        launching.runtime_env("ours", 2, DS_ACCELERATOR="cpu"), args.timeout, log=log)
    if launched.returncode != 0 or not raw.exists():
        print(f"FAILED: sync launch exit {launched.returncode}; log {log}", file=sys.stderr)
        return 1
    results = json.loads(raw.read_text())
    results.update(command=f"python -m deepspeed_zero3.bench --sync --repeats {args.repeats}", commit=source_commit(),
                   date=datetime.datetime.now().isoformat(timespec="seconds"), cpu_count=os.cpu_count(),
                   wall_seconds=round(time.time() - started, 1))
    text = tables(results)
    (out / "sync.md").write_text(text)
    (out / "sync.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return 0 if all(side["equal"] in (True, None) for side in results["methods"].values()) else 1


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        code = worker(int(sys.argv[at + 1]), sys.argv[at + 2])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
