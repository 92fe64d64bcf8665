"""``get_zero3_stats(engine)["live_by_reason"]`` ([Note: residency]): the live numel split by why each parameter
is gathered, pinned where something stays gathered between passes, two ranks.

Model A (6,312,196 parameters, bucket 100,000) capped at half: a forward keeps for its backward the tail that
fits in cap - bucket, head + 5 blocks + the next down = 2,891,268 (test_keeping.py). Model B (199,876
parameters, bucket 20,000) capped at half: an eval forward keeps for the next the prefix that fits in the cap,
inp + 2 blocks + the third up = 83,904 (test_nograd_keeping.py).
"""

import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.instrument import GatherMeter
from deepspeed_zero3.testing.models import ReadsAhead, model_a, model_b

DEFAULT = 1_000_000_000
NOTHING = {"reuse": 0, "for_backward": 0, "for_next_eval": 0, "stream": 0, "getter": 0, "in_use": 0, "held": 0,
           "ahead": 0}


def live(engine):
    stats = deepspeed_zero3.get_zero3_stats(engine)
    by_reason = stats["live_by_reason"]
    assert sum(by_reason.values()) - by_reason["stream"] == stats["live_numel"]
    return by_reason


def train(engine, step):
    engine.backward(mse_loss(engine(batch(step, torch.distributed.get_rank()))))
    engine.step()


def test_a_capped_forward_keeps_its_tail_for_the_backward():
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=100_000, reuse=DEFAULT, max_live=6_312_196 // 2))
    train(engine, 0)
    assert live(engine) == NOTHING
    loss = mse_loss(engine(batch(1, torch.distributed.get_rank())))
    assert live(engine) == dict(NOTHING, for_backward=2_891_268)
    engine.backward(loss)
    assert live(engine) == NOTHING  # the backward ends: nothing survives it
    engine.step()
    engine.destroy()


def test_eval_forwards_under_a_cap_carry_their_prefix_to_the_next():
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=DEFAULT, max_live=199_876 // 2))
    train(engine, 0)
    with torch.no_grad():
        for token in range(3):
            engine(batch(100 + token, torch.distributed.get_rank()))
            assert live(engine) == dict(NOTHING, for_next_eval=83_904), token
    train(engine, 1)  # its forward uses the carry; its step releases everything
    assert live(engine) == NOTHING
    engine.destroy()


def test_a_weight_streams_buckets_are_held_for_the_stream():
    """Model B, bucket 20,000 (test_weight_stream.py): while the consumer reads the second bucket (block 0's down,
    16,448) the third (block 1's up, 16,640) is in flight ahead; both are the stream's, outside live_numel."""
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    train(engine, 0)
    seen = []
    for names, _ in deepspeed_zero3.iter_gathered_parameters(engine).iter_groups():
        stats = deepspeed_zero3.get_zero3_stats(engine)
        seen.append((names, stats["live_numel"], stats["live_by_reason"]))
    names, live_numel, by_reason = seen[1]
    assert names == ["blocks.0.down.weight", "blocks.0.down.bias"]
    assert live_numel == 0 and by_reason == dict(NOTHING, stream=16_448 + 16_640)
    assert live(engine) == NOTHING  # the stream ended: nothing held
    engine.destroy()


class ParentReadsChild(torch.nn.Module):
    """The root reads ``b``'s parameters directly and never runs ``b``: every read of them is the getter's."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) @ self.b.weight.t() + self.b.bias


@pytest.mark.parametrize("bucket", [0, 300])
@pytest.mark.parametrize("make", [ParentReadsChild, ReadsAhead], ids=["parent_reads_child", "reads_ahead"])
def test_every_all_gather_is_counted_first_pass_included(make, bucket):
    """An all-gather count at deepspeed.comm (the meter upstream's figures use) equals get_zero3_stats', pass by
    pass from the first: training steps, an eval forward, another step."""
    torch.manual_seed(0)
    model = make()
    engine = training_engine(model, zero3_config(bucket=bucket, reuse=0))
    rank = torch.distributed.get_rank()
    counted = []
    with GatherMeter(model) as meter:
        for step in range(4):
            before = meter.phases["other"].allgather_calls
            if step == 2:
                with torch.no_grad():
                    engine(batch(100, rank))
            else:
                train(engine, step)
            counted.append(meter.phases["other"].allgather_calls - before)
    stats = deepspeed_zero3.get_zero3_stats(engine)
    by_step, index = [], 0
    for step in range(4):
        kinds = ["eval_forward"] if step == 2 else ["forward", "backward"]
        records = stats["passes"][index:index + len(kinds)]
        assert [p["kind"] for p in records] == kinds
        by_step.append(sum(p["allgather_calls"] for p in records))
        index += len(kinds)
    assert stats["outside_pass"]["allgather_calls"] == 0
    assert by_step == counted
    engine.destroy()
