"""Sync a ZeRO-3 model's weights to an inference engine in another process, as RL stacks sync vLLM.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29702 examples/sync_to_inference.py

Two trainer ranks train a TinyGPT under ZeRO-3. Trainer rank 0 starts a receiver process outside the training
group: it holds a plain TinyGPT, the stand-in for an inference engine. Trainer rank 0 and the receiver share a
second process group of their own (this example builds a gloo group, on CPU tensors; a sender over CUDA tensors needs an NCCL group), built from a TCP store as RL stacks build theirs.
After every step the weights go over it:

1. the metadata first (``stream.vllm_update_info()``: names, dtype names, shapes, and the bucket each is in),
   so the receiver allocates before any data;
2. then each bucket of the weight stream as one flat buffer per dtype, with the next bucket's all-gather
   already in flight while rank 0 sends.

``deepspeed_zero3.WeightSender(engine, group).send()`` on every trainer rank and
``deepspeed_zero3.receive_weights(group, model)`` on the receiver do both steps.

The receiver's weights must then equal the trainer's bitwise, and its greedy generation the trainer's. At the
end rank 0 prints the sync time side by side with two others over the same group: the per-parameter pattern
(``GatheredParameters([p])``, one broadcast per tensor, as commonly written) and one raw broadcast of the same
bytes, prebuilt (the wire bound).
"""

import argparse
import datetime
import multiprocessing
import socket
import statistics
import time

import torch
import torch.distributed as dist

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.models import TinyGPT  # a small causal transformer: any nn.Module would do

MODEL = dict(vocab=128, dim=64, heads=4, layers=4, max_seq=64)
TIMEOUT = datetime.timedelta(seconds=120)


def ds_config(bucket: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": bucket, "stage3_max_reuse_distance": 0},
        "steps_per_print": 10**9,
    }


# ------------------------------------------------------------------ the second group: rank 0 and the receiver


def sync_group(rank_in_group: int, port: int):
    """A process group of two outside the training group: trainer rank 0 (0) and the receiver (1)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank_in_group == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(store, rank_in_group, 2, TIMEOUT)


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


# ------------------------------------------------------------------ trainer side


def send_per_parameter(engine, group) -> None:
    """The common pattern, for comparison: a gather, a broadcast and a wait per parameter."""
    for _, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if group is not None:
                broadcast(group, param.data)


# ------------------------------------------------------------------ receiver side


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(new_tokens):
        tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens


def prompt_for(step: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab"], (2, 4), generator=torch.Generator().manual_seed(100 + step))


def receiver(port: int, steps: int, new_tokens: int, timed: int) -> None:
    """The inference process: a plain model, updated only by what arrives over the group."""
    torch.manual_seed(1)  # other initial weights than the trainer's: only the sync can make them equal
    model = TinyGPT(**MODEL).eval()
    group = sync_group(1, port)
    for step in range(steps):
        deepspeed_zero3.receive_weights(group, model)
        for name, param in model.named_parameters():  # the trainer checks these bitwise
            broadcast(group, param.data.clone(), root=1)
        broadcast(group, greedy(model, prompt_for(step), new_tokens), root=1)
    for _ in range(timed):  # the side-by-side timings: the stream, per parameter, raw
        deepspeed_zero3.receive_weights(group, model)
        for param in model.parameters():
            broadcast(group, torch.empty_like(param))
        broadcast(group, torch.empty(sum(p.numel() for p in model.parameters())))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--bucket", type=int, default=50_000, help="stage3_prefetch_bucket_size, also the stream's")
    parser.add_argument("--timed", type=int, default=5, help="timed syncs per method at the end")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args.bucket))

    group, child = None, None
    if rank == 0:
        port = free_port()
        child = multiprocessing.get_context("spawn").Process(
            target=receiver, args=(port, args.steps, args.new_tokens, args.timed))
        child.start()
        group = sync_group(0, port)
    sender = deepspeed_zero3.WeightSender(engine, group)  # group None on the other trainer ranks

    for step in range(args.steps):
        tokens = torch.randint(0, MODEL["vocab"], (4, 17), generator=torch.Generator().manual_seed(step * 7 + rank))
        inputs, targets = tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device)
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        sender.send()
        engine.eval()
        ours = greedy(engine.module, prompt_for(step).to(engine.device), args.new_tokens)
        engine.train()
        theirs = {}
        if rank == 0:  # what the receiver now holds, and what it generated
            for name, param in engine.module.named_parameters():
                theirs[name] = torch.empty(tuple(param.ds_shape), dtype=param.dtype)
                broadcast(group, theirs[name], root=1)
            received = torch.empty_like(ours.cpu())
            broadcast(group, received, root=1)
        for name, param in engine.module.named_parameters():  # every trainer rank gathers: a collective
            with deepspeed.zero.GatheredParameters([param]):
                if rank == 0 and not torch.equal(theirs[name], param.data.cpu()):
                    raise SystemExit(f"step {step}: the receiver's {name} differs from the trainer's")
        if rank == 0:
            if not torch.equal(received, ours.cpu()):
                raise SystemExit(f"step {step}: the receiver generated {received.tolist()}, the trainer "
                                 f"{ours.tolist()}")
            print(f"step {step}: loss {loss.item():.4f}; the receiver's weights equal the trainer's bitwise, and "
                  f"its {args.new_tokens} generated tokens too", flush=True)

    timings = {"stream, flat buckets": [], "per parameter": [], "raw broadcast (wire bound)": []}
    raw = torch.zeros(sum(p.ds_numel for p in engine.module.parameters())) if rank == 0 else None
    for _ in range(args.timed):
        for method, run in (("stream, flat buckets", sender.send),
                            ("per parameter", lambda: send_per_parameter(engine, group)),
                            ("raw broadcast (wire bound)", lambda: group is not None and broadcast(group, raw))):
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            timings[method].append(time.perf_counter() - start)
    if rank == 0:
        child.join(timeout=60)
        numel = sum(p.ds_numel for p in engine.module.parameters())
        print(f"sync to another process: {numel:,} parameters, median of {args.timed} (wall ms, rank 0)")
        base = statistics.median(timings["raw broadcast (wire bound)"])
        for method, walls in timings.items():
            print(f"  {method:28s} {statistics.median(walls) * 1000:8.1f} ms  {statistics.median(walls) / base:5.1f}x "
                  f"the wire bound")
        print("sync to inference: the receiver matched the trainer after every step")
    engine.destroy()


if __name__ == "__main__":
    main()
