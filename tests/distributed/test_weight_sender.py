"""``deepspeed_zero3.WeightSender`` and ``receive_weights`` between two trainer ranks and a receiver process outside the
training group, over a gloo group of two (trainer rank 0 and the receiver) built from a TCP store.

Model B, bucket 20,000 (12 buckets). After each of two training steps one ``send()`` on every trainer rank and one
``receive_weights`` on the receiver leave the receiver's weights equal to the trainer's bitwise. A receiver that dies
after the metadata ends every trainer rank with an error, rank 0's naming the failed bucket: no hang.
"""

import datetime
import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist

import deepspeed_zero3
from deepspeed_zero3.sender import ReceiverFailed, receive_weights
from deepspeed_zero3.testing.engines import batch, gathered_copies, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

TIMEOUT = datetime.timedelta(seconds=20)


def pair_group(rank_in_group: int, port: int):
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank_in_group == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(store, rank_in_group, 2, TIMEOUT)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def broadcast(group, tensor, root):
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


def receiver(port: int, syncs: int, die_after_metadata: bool) -> None:
    torch.manual_seed(1)
    model = model_b()
    group = pair_group(1, port)
    if die_after_metadata:
        from deepspeed_zero3.sender import _receive_object
        _receive_object(group, 0)
        return  # the process ends: its connection closes
    for _ in range(syncs):
        receive_weights(group, model)
        broadcast(group, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), root=1)


def start(syncs: int, die_after_metadata: bool = False):
    """Trainer rank 0 starts the receiver and joins its group; the other trainer ranks get None."""
    if torch.distributed.get_rank() != 0:
        return None, None
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=receiver, args=(port, syncs, die_after_metadata))
    child.start()
    return child, pair_group(0, port)


def test_the_receiver_gets_the_trainers_weights_bitwise():
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    child, group = start(syncs=2)
    sender = deepspeed_zero3.WeightSender(engine, group)
    for step in range(2):
        train_step(engine, batch(step, rank))
        sender.send()
        expected = torch.cat([p.reshape(-1) for p in gathered_copies(model.parameters())])
        if rank == 0:
            theirs = torch.empty_like(expected)
            broadcast(group, theirs, root=1)
            assert torch.equal(theirs, expected), f"step {step}"
    if child is not None:
        child.join(timeout=30)
        assert child.exitcode == 0
    assert sender.syncs == 2
    engine.destroy()


def test_a_receiver_that_dies_ends_every_trainer_rank():
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    child, group = start(syncs=1, die_after_metadata=True)
    if child is not None:
        child.join(timeout=30)  # dead before the first bucket
    sender = deepspeed_zero3.WeightSender(engine, group)
    expected = ReceiverFailed if rank == 0 else RuntimeError
    with pytest.raises(expected) as raised:
        sender.send()
    if rank == 0:
        assert "to the receivers failed on trainer rank 0" in str(raised.value)
    else:  # stopped by the stream's lockstep after the same bucket, naming rank 0 and its error
        assert "rank 0" in str(raised.value) and "ReceiverFailed" in str(raised.value), str(raised.value)
    train_step(engine, batch(9, rank))  # the model is left released and in step
    engine.destroy()


def test_bad_input_is_refused():
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    with pytest.raises(TypeError, match=r"WeightSender: group='group' is not a process group"):
        deepspeed_zero3.WeightSender(engine, "group")
    with pytest.raises(ValueError, match=r"bucket_numel=-2 is not allowed"):
        deepspeed_zero3.WeightSender(engine, None, bucket_numel=-2)
    engine.destroy()
