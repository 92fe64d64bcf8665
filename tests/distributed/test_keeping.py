"""Budgeted keeping ([Note: budgeted keeping]): a forward keeps the backward's first parameters, within the cap.

Model A (6,312,196 parameters, bucket 100,000), two ranks. Modules: inp 4,352; 12 blocks of up 263,168 +
down 262,400 (525,568); head 1,028. The backward runs head, down 11, up 11, ...; what a forward keeps is
the longest such tail whose numel fits in cap - bucket, walked parameter by parameter (weight before bias).
"""

import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import MODEL_A_NUMEL, model_a

MODEL_A = MODEL_A_NUMEL
BLOCK, UP, DOWN, HEAD = 525_568, 263_168, 262_400, 1_028
BUCKET = 100_000
DEFAULT = 1_000_000_000

# cap -> kept numel (head + whole blocks + the down of the next block), the tail that fits in cap - bucket
KEPT = {
    MODEL_A // 2: HEAD + 5 * BLOCK + DOWN,  # 2,891,268 of room 3,056,098
    MODEL_A // 4: HEAD + 2 * BLOCK + DOWN,  # 1,314,564 of room 1,478,049
    MODEL_A // 10: HEAD + DOWN + UP,  # 526,596 of room 531,219
}
# cap -> (forward peak, backward peak): the backward starts with what was kept plus its first window
PEAKS = {
    MODEL_A // 2: (2_891_268, 3_154_436),
    MODEL_A // 4: (1_314_564, 1_577_732),
    MODEL_A // 10: (526_596, 788_996),
}


def train(engine, step):
    engine.backward(mse_loss(engine(batch(step, torch.distributed.get_rank()))))
    engine.step()


@pytest.mark.parametrize("cap", sorted(KEPT))
def test_a_capped_forward_keeps_the_tail_for_backward(cap):
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=BUCKET, reuse=DEFAULT, max_live=cap))
    for step in range(2):
        train(engine, step)
    records = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert [p["kind"] for p in records] == ["forward", "backward"] * 2
    kept = KEPT[cap]
    forward_peak, backward_peak = PEAKS[cap]
    for forward, backward in (records[0:2], records[2:4]):  # the first step too: it keeps for the reversed guess
        assert forward["allgather_numel"] == MODEL_A and forward["demand_numel"] == 0, forward
        assert backward["allgather_numel"] == MODEL_A - kept and backward["demand_numel"] == 0, backward
        assert forward["peak_live_numel"] == forward_peak and backward["peak_live_numel"] == backward_peak
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()


@pytest.mark.parametrize("cap", [None, MODEL_A // 4])
def test_reuse_zero_keeps_only_what_the_backwards_first_window_gathers(cap):
    """Reuse distance 0 keeps a parameter only if it is back within one bucket: head and the last down."""
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=BUCKET, reuse=0, max_live=cap))
    for step in range(2):
        train(engine, step)
    records = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    for forward, backward in (records[0:2], records[2:4]):  # the first step keeps for the reversed guess
        assert forward["allgather_numel"] == MODEL_A and forward["demand_numel"] == 0, forward
        # distances: head 0, down 11 = head after it in the forward + head before it in the backward, up 11 > bucket
        assert backward["allgather_numel"] == MODEL_A - (HEAD + DOWN) and backward["demand_numel"] == 0, backward
        assert forward["peak_live_numel"] == UP + DOWN, forward
        assert backward["peak_live_numel"] == HEAD + DOWN + UP, backward  # kept + the first window's up 11
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()


def test_default_cap_and_reuse_keep_the_whole_model_from_the_first_step():
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=BUCKET, reuse=DEFAULT))
    train(engine, 0)
    forward, backward = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert forward["allgather_numel"] == MODEL_A and forward["peak_live_numel"] == MODEL_A
    assert backward["allgather_calls"] == 0 and backward["demand_numel"] == 0
    engine.destroy()


def test_reuse_distance_bounds_the_kept_tail():
    """A reuse distance of 1.5M numel keeps only what the backward uses within 1.5M numel of the forward's end."""
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=BUCKET, reuse=1_500_000))
    for step in range(2):
        train(engine, step)
    forward, backward = deepspeed_zero3.get_zero3_stats(engine)["passes"][2:]
    assert backward["demand_numel"] == 0
    # distance of a kept parameter = forward numel after its last use + backward numel before its first use
    assert MODEL_A - backward["allgather_numel"] == HEAD + BLOCK + DOWN, backward
    engine.destroy()


def test_forwards_that_no_backward_follows_stop_keeping():
    """Forwards with grad that no backward follows (scoring with grad on, upstream's ``TestZeroPartitionCache``
    with ``training=False``) keep at the first only; keeping comes back once a step of one forward and one
    backward has run again ([Note: budgeted keeping])."""
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=BUCKET, reuse=DEFAULT))
    live = lambda: deepspeed_zero3.get_zero3_stats(engine)["live_numel"]
    x = batch(0, torch.distributed.get_rank())
    engine(x)
    assert live() == MODEL_A  # kept whole for the backward the first forward expects
    engine(x)  # a forward starts by releasing what the last one kept; the second since a backward keeps nothing
    assert live() == 0
    train(engine, 1)  # the third forward: keeps nothing; its backward records 3 forwards per backward
    train(engine, 2)  # the first forward of its step, 3 expected: keeps nothing; this backward records 1
    train(engine, 3)  # keeps the whole model again: its backward gathers nothing
    records = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert [p["kind"] for p in records] == ["forward"] * 3 + ["backward", "forward", "backward", "forward", "backward"]
    assert [p["allgather_numel"] for p in records] == [MODEL_A] * 7 + [0]
    assert all(p["demand_numel"] == 0 for p in records), records
    assert live() == 0
    engine.destroy()


def test_two_forwards_per_backward_keep_at_the_second():
    """A loss over two forwards, one backward: once a step has shown it, the second forward keeps."""
    torch.manual_seed(0)
    engine = training_engine(model_a(), zero3_config(bucket=BUCKET, reuse=DEFAULT))
    rank = torch.distributed.get_rank()
    for step in range(3):
        loss = mse_loss(engine(batch(2 * step, rank))) + mse_loss(engine(batch(2 * step + 1, rank)))
        engine.backward(loss)
        engine.step()
    records = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert [p["kind"] for p in records] == ["forward", "forward", "backward"] * 3
    # Step 0: the first forward keeps (1 expected) and the second releases it; later steps keep at the second.
    # Step 0's backward, before any backward trace, gathers every parameter once per forward graph except
    # inp's (12,620,040 = 2 x 6,312,196 - 4,352) ...
    assert [p["allgather_numel"] for p in records] == [MODEL_A, MODEL_A, 2 * MODEL_A - 4_352] + [MODEL_A, MODEL_A, 0] * 2
    # ... the second graph's half on demand: the reversed guess holds each module once ([Note: first-pass
    # prediction]). From step 1 on the backward replays its own trace.
    assert [p["demand_numel"] for p in records] == [0, 0, MODEL_A - 4_352] + [0] * 6
    engine.destroy()
