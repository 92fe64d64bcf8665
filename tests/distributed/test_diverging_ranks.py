"""Ranks that run different modules stop with an error on every rank, naming rank, step and module."""

import contextlib
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
import deepspeed_zero3
from deepspeed_zero3.runtime.zero import capabilities
from deepspeed_zero3.runtime.zero.rank_agreement import CHECK_RANKS_ENV, MAX_PENDING_PASSES
from deepspeed_zero3.testing.engines import (batch, gathered_copies, mse_loss, train_step, training_engine,
                                             zero3_config)
from deepspeed_zero3.testing.models import model_b

# A forward on one rank alone inside GatheredParameters gathers nothing and releases nothing the runtime did not
# gather ([Note: residency]), so it is silent on every release. Between a forward and its backward, what the forward
# kept for the backward is the runtime's own: only where the context marks what it holds (deepspeed 0.19.4 on,
# [Note: release capabilities]) does the runtime leave it alone; before, see the test of what happens instead.
needs_gathered_context_mark = pytest.mark.skipif(
    capabilities.GATHERED_CONTEXT_DEPTH_ATTR is None,
    reason="this deepspeed release's GatheredParameters does not mark what it holds (from 0.19.4): a forward on one "
    "rank under it between a forward and its backward releases what was kept for the backward")


class RankDependent(torch.nn.Module):
    """Data-dependent control flow that differs across ranks when told to: on rank 1, block 2 is skipped
    (``diverge="skip"``) or runs after block 3 (``diverge="swap"``)."""

    def __init__(self):
        super().__init__()
        self.inner = model_b()
        self.diverge = None

    def forward(self, x):
        order = list(range(len(self.inner.blocks)))
        if torch.distributed.get_rank() == 1 and self.diverge == "skip":
            order.remove(2)
        if torch.distributed.get_rank() == 1 and self.diverge == "swap":
            order[2], order[3] = 3, 2
        h = self.inner.inp(x)
        for index in order:
            h = self.inner.blocks[index](h)
        return self.inner.head(h)


@contextlib.contextmanager
def counted_all_gathers():
    """The numel of every rank-agreement all_gather in the block (the runtime's gathers use other calls)."""
    calls = []
    original = dist.all_gather

    def counting(tensor_list, tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor_list, tensor, *args, **kwargs)

    dist.all_gather = counting
    try:
        yield calls
    finally:
        dist.all_gather = original


@pytest.fixture
def check_ranks():
    os.environ[CHECK_RANKS_ENV] = "1"
    yield
    del os.environ[CHECK_RANKS_ENV]


def test_debug_mode_names_rank_step_and_module(check_ranks):
    torch.manual_seed(0)
    model = RankDependent()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    for step in range(2):
        train_step(engine, batch(step, torch.distributed.get_rank()))
    model.diverge = "skip"
    with pytest.raises(RuntimeError) as info:
        engine(batch(2, torch.distributed.get_rank()))
    message = str(info.value)
    assert f"{CHECK_RANKS_ENV}=1): ranks diverged in a forward pass" in message
    # Steps: 0 root, 1 inp, then 3 per block: step 8 is block 2 on rank 0 and block 3 on rank 1.
    assert "rank 0: step 8 module ds_id=" in message and "rank 1: step 8 module ds_id=" in message
    assert "No mismatched all-gather was issued. ZeRO-3 needs every rank to run the same modules" in message
    # Nothing mismatched was issued: the process group still works, and so does the engine.
    model.diverge = None
    assert train_step(engine, batch(3, torch.distributed.get_rank())) > 0
    engine.destroy()


def test_bad_check_ranks_value():
    os.environ[CHECK_RANKS_ENV] = "sometimes"
    try:
        with pytest.raises(ValueError, match=rf"{CHECK_RANKS_ENV}='sometimes' is not allowed: use 1"):
            training_engine(model_b(), zero3_config())
    finally:
        del os.environ[CHECK_RANKS_ENV]


def test_default_check_at_the_next_backward_names_rank_pass_step_and_module():
    """Without the debug mode: a replayed trace, ranks swap two equally sized blocks in a no-grad forward (so
    every all-gather pairs up, with the wrong shards). The eval forward's order is compared at the next
    backward ([Note: diverging ranks]), which raises on every rank before its optimizer step."""
    torch.manual_seed(0)
    model = RankDependent()
    engine = training_engine(model, zero3_config(bucket=0, reuse=0))
    for step in range(2):
        train_step(engine, batch(step, torch.distributed.get_rank()))
        with torch.no_grad():
            engine(batch(10 + step, torch.distributed.get_rank()))
    model.diverge = "swap"
    with torch.no_grad():
        engine(batch(12, torch.distributed.get_rank()))  # pass 6: not compared yet
    model.diverge = None
    with pytest.raises(RuntimeError) as info:
        train_step(engine, batch(2, torch.distributed.get_rank()))  # passes 7 and 8; the check ends pass 8
    message = str(info.value)
    blocks = model.inner.blocks
    # Passes 5..8: the eval forward after step 1, the diverging one, then the forward and backward of step 2.
    # Steps: 0 root, 1 inp, 3 per block: step 8 is block 2 (rank 0) or block 3 (rank 1).
    assert "deepspeed-zero3: ranks ran different modules (checked after pass 8, covering passes 5..8)" in message
    assert f"rank 0: eval_forward pass, step 8, module ResidualMLPBlock ds_id={blocks[2].ds_id}" in message
    assert f"rank 1: eval_forward pass, step 8, module ResidualMLPBlock ds_id={blocks[3].ds_id}" in message
    assert "this step must not be applied" in message and f"Set {CHECK_RANKS_ENV}=1 to stop before" in message
    deepspeed_zero3.abandon_step(engine)
    assert train_step(engine, batch(3, torch.distributed.get_rank())) > 0
    engine.destroy()


def test_default_check_after_a_batch_of_no_grad_forwards():
    """No backward follows (an inference-only loop, generation): the orders are compared after every
    MAX_PENDING_PASSES passes. A swap in the 3rd no-grad forward after the last check raises in the
    MAX_PENDING_PASSES-th, on every rank, naming that pass."""
    torch.manual_seed(0)
    model = RankDependent()
    engine = training_engine(model, zero3_config(bucket=0, reuse=0))
    train_step(engine, batch(0, torch.distributed.get_rank()))  # passes 0, 1; checked at the end of 1
    completed = 0
    with pytest.raises(RuntimeError) as info:
        with torch.no_grad():
            for step in range(MAX_PENDING_PASSES):
                model.diverge = "swap" if step == 2 else None
                engine(batch(10 + step, torch.distributed.get_rank()))
                completed += 1
    model.diverge = None
    assert completed == MAX_PENDING_PASSES - 1  # the last one raised, at its end
    last = 1 + MAX_PENDING_PASSES
    message = str(info.value)
    blocks = model.inner.blocks
    assert f"(checked after pass {last}, covering passes 2..{last})" in message
    assert f"rank 0: eval_forward pass, step 8, module ResidualMLPBlock ds_id={blocks[2].ds_id}" in message
    assert f"rank 1: eval_forward pass, step 8, module ResidualMLPBlock ds_id={blocks[3].ds_id}" in message
    assert train_step(engine, batch(1, torch.distributed.get_rank())) > 0
    engine.destroy()


def rank_agreement_calls_per_pass(engine, passes):
    """Run ``passes`` (callables, one pass each) and return the rank-agreement all_gathers each one made."""
    made = []
    with counted_all_gathers() as calls:
        for run in passes:
            before = len(calls)
            run()
            made.append(calls[before:])
    return made


@pytest.mark.parametrize("agreement", ["1", "0"])
def test_default_check_costs_one_small_collective_per_backward_and_per_batch_of_passes(agreement, monkeypatch):
    """The always-on order check adds exactly one all_gather of 3 integers per backward pass, and one per
    MAX_PENDING_PASSES passes without a backward. The pass agreement ([Note: ranks in different passes]) adds one
    more before each pass that gathers: here every pass gathers (bucket 0, reuse 0), so a training step makes 3
    (its forward's and its backward's agreement, then the order check) and every no-grad forward 1.
    DEEPSPEED_ZERO3_PASS_AGREEMENT=0 leaves the order check alone: 1 per step and none in a no-grad forward."""
    monkeypatch.setenv("DEEPSPEED_ZERO3_PASS_AGREEMENT", agreement)
    per_pass = 1 if agreement == "1" else 0
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = training_engine(RankDependent(), zero3_config(bucket=0, reuse=0))
    train_step(engine, batch(0, rank))

    def no_grad_forward(step):
        with torch.no_grad():
            engine(batch(100 + step, rank))

    # A training step and an eval forward: the eval forward's order is compared at the next backward.
    step = [3] * (2 * per_pass + 1)
    assert rank_agreement_calls_per_pass(engine, [
        lambda: train_step(engine, batch(1, rank)),
        lambda: no_grad_forward(0),
        lambda: train_step(engine, batch(2, rank)),
    ]) == [step, [3] * per_pass, step]
    # A generation loop of 2 * MAX_PENDING_PASSES + 5 tokens: one order check per MAX_PENDING_PASSES tokens.
    tokens = 2 * MAX_PENDING_PASSES + 5
    made = rank_agreement_calls_per_pass(engine, [lambda step=step: no_grad_forward(step) for step in range(tokens)])
    checked = [MAX_PENDING_PASSES - 1, 2 * MAX_PENDING_PASSES - 1]
    assert [len(calls) for calls in made] == [per_pass + (index in checked) for index in range(tokens)]
    assert sum(made, []) == [3] * (tokens * per_pass + 2)
    # The 5 tokens left over are compared with the next training step's orders, in its one check.
    assert rank_agreement_calls_per_pass(engine, [lambda: train_step(engine, batch(3, rank))]) == [step]
    engine.destroy()


def test_no_grad_forward_on_one_rank_under_gathered_parameters():
    """Rank 0 alone runs a no-grad forward inside GatheredParameters over the whole model (a sample or a log on
    one rank). It gathers nothing, so it must leave no trace, no pending order check and no collective behind.

    Upstream 0.19.8 hangs here until the process-group timeout (measured with the same loop under the kill
    switch): its reset_step compares trace lengths across ranks (assert_ints_same_as_other_ranks, a
    broadcast) at the end of the solo forward, which only rank 0 reaches. Ours did too, in its order check.
    """
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    with counted_all_gathers() as checks:
        for step in range(3):
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                if rank == 0:
                    with torch.no_grad():
                        model(batch(200 + step, 0))
            train_step(engine, batch(step, rank))
            with torch.no_grad():
                engine(batch(100 + step, rank))
    records = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    solo = [p for p in records if p["allgather_calls"] == 0]
    shared = [p for p in records if p["allgather_calls"] > 0]
    assert len(solo) == (3 if rank == 0 else 0)
    assert all(p["kind"] == "eval_forward" and p["trace_records"] == 0 for p in solo), solo
    assert [p["kind"] for p in shared] == ["forward", "backward", "eval_forward"] * 3
    assert [p["trace_records"] for p in shared] == [1, 1, 1] + [0] * 6
    assert all(p["demand_numel"] == 0 for p in shared[3:]), shared
    # Per step: the forward's and the backward's pass agreements, the order check after the backward (eval forwards
    # join the next one), the eval forward's agreement ([Note: ranks in different passes]); the solo forward, which
    # gathers nothing, none. (Before the pass agreement: [3] * 3, the order checks alone.)
    assert checks == [3] * 12
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()


@pytest.mark.skipif(capabilities.GATHERED_CONTEXT_DEPTH_ATTR is not None,
                    reason="this deepspeed release marks what GatheredParameters holds: the solo forward is silent")
def test_without_the_mark_a_solo_forward_before_a_backward_stops_every_rank():
    """Before 0.19.4 nothing tells the context's hold on what the forward kept for its backward from the runtime's
    own keeping: the solo forward releases it at each module, as upstream's does, and gathers it again, so it is
    not silent. The pass agreement before its first all-gather stops every rank with the passes named, rank 0 in its
    solo forward and rank 1 in its backward, instead of a mismatched collective."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=10**9))
    train_step(engine, batch(0, rank))
    loss = mse_loss(engine(batch(1, rank)))
    with pytest.raises(deepspeed_zero3.RanksInDifferentPasses) as raised:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            if rank == 0:
                with torch.no_grad():
                    model(batch(200, 0))
        engine.backward(loss)
    assert "rank 0: eval_forward pass" in str(raised.value) and "rank 1: backward pass" in str(raised.value)
    deepspeed_zero3.abandon_step(engine)
    engine.destroy()


class Twice(torch.nn.Module):
    """``a`` runs twice in one forward: its parameters are used again after their first release."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.a(self.b(self.a(x)))


@needs_gathered_context_mark
@pytest.mark.parametrize("make_model", [model_b, Twice], ids=["model_b", "module_run_twice"])
def test_one_rank_forward_between_a_forward_and_its_backward(make_model):
    """The same one-rank forward, now between a training forward and its backward, with upstream's default
    reuse distance (the forward keeps parameters for its backward), and with a module that runs twice.
    Parameters held by a GatheredParameters context are that context's until it exits: the runtime neither
    releases them after a module's use nor drops what it kept for the backward. Before that, rank 0 alone
    re-gathered them (measured with model_b at world size 1: 14 all-gathers, 199,876 numel, from the second
    step on) and the ranks hung."""
    rank = torch.distributed.get_rank()

    def run(solo: bool):
        torch.manual_seed(0)
        model = make_model()
        engine = training_engine(model, zero3_config(bucket=20_000, reuse=10**9))
        losses, solo_gathers = [], 0
        for step in range(3):
            loss = mse_loss(engine(batch(step, rank)))
            if solo:
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    if rank == 0:
                        with torch.no_grad():
                            model(batch(200 + step, 0))
                        solo_gathers += deepspeed_zero3.get_zero3_stats(engine)["passes"][-1]["allgather_calls"]
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
        params = gathered_copies(model.parameters())
        engine.destroy()
        return losses, params, solo_gathers

    losses, params, solo_gathers = run(solo=True)
    expected_losses, expected_params, _ = run(solo=False)
    assert solo_gathers == 0
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))


def test_grad_forward_on_one_rank_under_gathered_parameters_keeps_the_ranks_in_step():
    """Rank 0 alone runs a forward with grad enabled inside GatheredParameters (a loss logged without no_grad).
    It gathers nothing, so it must not count as a forward before the next backward: that count decides what the
    next forward keeps for its backward ([Note: budgeted keeping]), and a rank that kept other parameters would
    pair other all-gathers in the backward. Checked where it would go wrong: right after the next forward, every
    rank holds the same gathered numel; then the run equals one without the solo forward, counts and bits."""
    rank = torch.distributed.get_rank()

    def run(solo: bool):
        torch.manual_seed(0)
        model = model_b()
        engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
        losses = []
        for step in range(3):
            loss = mse_loss(engine(batch(step, rank)))
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, deepspeed_zero3.get_zero3_stats(engine)["live_numel"])
            # What the forward keeps for its backward at reuse 0 (head and the last down projection), on every rank.
            assert everyone == [16_708] * len(everyone), f"step {step}: gathered numel per rank {everyone}"
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if solo:
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    if rank == 0:
                        model(batch(200 + step, 0)).sum()
        records = [(p["kind"], p["allgather_calls"], p["allgather_numel"])
                   for p in deepspeed_zero3.get_zero3_stats(engine)["passes"] if p["allgather_calls"] > 0]
        params = gathered_copies(model.parameters())
        engine.destroy()
        return losses, params, records

    losses, params, records = run(solo=True)
    expected_losses, expected_params, expected_records = run(solo=False)
    assert records == expected_records
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
