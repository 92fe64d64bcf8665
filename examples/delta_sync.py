"""Sync a bf16 ZeRO-3 model to another process by sending only the elements that changed, from each rank's shard.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29703 examples/delta_sync.py

Two trainer ranks train a TinyGPT in bf16 under ZeRO-3. Trainer rank 0 starts a receiver process, the stand-in
for an inference engine that reshards: it holds the model as one flat bf16 buffer. Every trainer rank and the
receiver share a second process group (gloo here), built from a TCP store as RL stacks build theirs. After every
step each trainer rank, on its own and with no gather, reads its partitions (``deepspeed_zero3.iter_local_shards``),
compares them bit for bit with what it sent last time, and sends the receiver only the elements that changed: one
bit per element saying which, and their bf16 values. The first sync sends everything.

The receiver then sends its buffer back and each trainer rank checks its own slices of it: after every step the
receiver's weights equal the trainer's bitwise. Rank 0 prints the fraction of the model each sync sent, in elements and in bytes:
in bf16 an Adam update smaller than an element's rounding step leaves that element as it was, so a sync sends less
than the whole model.
"""

import argparse
import datetime
import multiprocessing
import socket
from typing import Tuple

import numpy
import torch
import torch.distributed as dist

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.models import TinyGPT  # a small causal transformer: any nn.Module would do

MODEL = dict(vocab=128, dim=64, heads=4, layers=4, max_seq=64)
TIMEOUT = datetime.timedelta(seconds=120)


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }


def sync_group(rank_in_group: int, size: int, port: int):
    """A process group outside the training group: the trainer ranks (0 .. size - 2) and the receiver (size - 1)."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank_in_group == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(store, rank_in_group, size, TIMEOUT)


# bf16 bits travel as bytes: gloo has no 16-bit integer type.
def send(group, tensor: torch.Tensor, peer: int) -> None:
    group.send([tensor.view(torch.uint8)], peer, 0).wait()


def receive(group, tensor: torch.Tensor, peer: int) -> None:
    group.recv([tensor.view(torch.uint8)], peer, 0).wait()


def broadcast(group, tensor: torch.Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor.view(torch.uint8)], options).wait()


# ------------------------------------------------------------------ trainer side


class DeltaSender:
    """One trainer rank's side: where its slices sit in the flattened model, the bits it sent last, and the sends.

    The receiver learns this rank's slices once (start and length of each, in the flattened model). Each sync then
    sends the number of changed elements, one bit per element of this rank's slices (packed: changed or not) and
    the changed elements' bf16 values: 1/8 byte per element plus 2 bytes per change, against 2 per element."""

    def __init__(self, engine, group, receiver_rank: int):
        self.engine, self.group, self.receiver = engine, group, receiver_rank
        self.sent = None  # the int16 bits of this rank's slices, as last sent
        spans, start = [], 0
        for shard in deepspeed_zero3.iter_local_shards(engine):
            spans.append((start + shard.offset, shard.tensor.numel()))
            start += shard.numel
        self.total = start
        send(group, torch.tensor([len(spans)], dtype=torch.int64), receiver_rank)
        send(group, torch.tensor(spans, dtype=torch.int64), receiver_rank)

    def sync(self) -> Tuple[int, int]:
        """Send what changed in this rank's slices since the last sync; returns (elements, bytes) sent."""
        bits = torch.cat([shard.tensor.reshape(-1).view(torch.int16)  # bf16 compared bit for bit
                          for shard in deepspeed_zero3.iter_local_shards(self.engine)])
        changed = torch.ones_like(bits, dtype=torch.bool) if self.sent is None else bits != self.sent
        self.sent = bits.clone()
        mask = torch.from_numpy(numpy.packbits(changed.numpy()))
        values = bits[changed]
        send(self.group, torch.tensor([values.numel()], dtype=torch.int64), self.receiver)
        send(self.group, mask, self.receiver)
        if values.numel():
            send(self.group, values, self.receiver)
        return values.numel(), 8 + mask.numel() + 2 * values.numel()

    def receiver_matches(self) -> bool:
        """The receiver's buffer, sent back to every trainer rank, against this rank's slices, bit for bit."""
        theirs = torch.empty(self.total, dtype=torch.int16)
        broadcast(self.group, theirs, root=self.receiver)
        start, ok = 0, True
        for shard in deepspeed_zero3.iter_local_shards(self.engine):
            here = theirs[start + shard.offset:][:shard.tensor.numel()]
            ok = ok and torch.equal(here, shard.tensor.reshape(-1).view(torch.int16))
            start += shard.numel
        return ok


# ------------------------------------------------------------------ receiver side


def receiver(port: int, trainers: int, steps: int) -> None:
    """The inference process: a flat bf16 buffer of the model, written only by what arrives."""
    torch.manual_seed(1)  # other initial weights than the trainer's: only the syncs can make them equal
    model = TinyGPT(**MODEL).to(torch.bfloat16)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.int16)
    group = sync_group(trainers, trainers + 1, port)
    positions = []  # per trainer rank: where each element of its slices sits in the flattened model
    for trainer in range(trainers):
        count = torch.zeros(1, dtype=torch.int64)
        receive(group, count, trainer)
        spans = torch.empty(int(count.item()), 2, dtype=torch.int64)
        receive(group, spans, trainer)
        positions.append(torch.cat([torch.arange(start, start + length) for start, length in spans.tolist()]))
    for _ in range(steps):
        for trainer in range(trainers):
            count = torch.zeros(1, dtype=torch.int64)
            receive(group, count, trainer)
            mask = torch.empty((positions[trainer].numel() + 7) // 8, dtype=torch.uint8)
            receive(group, mask, trainer)
            if count.item():
                changed = torch.from_numpy(numpy.unpackbits(mask.numpy())[:positions[trainer].numel()]).bool()
                values = torch.empty(int(count.item()), dtype=torch.int16)
                receive(group, values, trainer)
                flat[positions[trainer][changed]] = values
        broadcast(group, flat, root=trainers)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config())

    child = None
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    if rank == 0:
        child = multiprocessing.get_context("spawn").Process(target=receiver, args=(port[0], world, args.steps))
        child.start()
    group = sync_group(rank, world + 1, port[0])
    sender = DeltaSender(engine, group, receiver_rank=world)

    for step in range(args.steps):
        tokens = torch.randint(0, MODEL["vocab"], (4, 17), generator=torch.Generator().manual_seed(step * 7 + rank))
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        sent = torch.tensor(sender.sync(), dtype=torch.int64)
        matches = torch.tensor([int(sender.receiver_matches())])
        dist.all_reduce(sent)
        dist.all_reduce(matches, op=dist.ReduceOp.MIN)
        if not matches.item():
            raise SystemExit(f"step {step}: the receiver's weights differ from the trainer's")
        if rank == 0:
            elements, sent_bytes = sent.tolist()
            print(f"step {step}: loss {loss.item():.4f}; sent {elements:,} of {sender.total:,} bf16 elements "
                  f"({elements / sender.total:.1%}), {sent_bytes:,} bytes ({sent_bytes / (2 * sender.total):.1%} of "
                  f"the full model's); the receiver's weights equal the trainer's bitwise", flush=True)
    if rank == 0:
        child.join(timeout=60)
        print("delta sync: the receiver matched the trainer after every step")
    engine.destroy()


if __name__ == "__main__":
    main()
