"""Ranks that stop generating at different tokens ([Note: ranks in different passes]), two ranks.

``SameLayers``: 6 identical Linear(16, 16) layers (272 numel each, 1,632 in all), so a training forward's gathers
and a decode step's have the same sizes and would pair without an error. Rank 0 runs 6 no-grad forwards (a
generate() that stopped at its own end-of-sequence token), rank 1 runs 18, then both train a step. Parameter
all-gathers are counted at torch.distributed, below deepspeed.
"""


import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.collectives import parameter_gathers
from deepspeed_zero3.testing.engines import batch, gathered_copies, mse_loss, training_engine, zero3_config

LAYER = 16 * 16 + 16
MODEL = 6 * LAYER
DEFAULT = 1_000_000_000
TOKENS = {0: 6, 1: 18}


class SameLayers(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def train(engine, step):
    loss = mse_loss(engine(batch(step, torch.distributed.get_rank())))
    engine.backward(loss)
    engine.step()
    return loss.item()


def run(tokens, cap=None, step_1=True):
    """Step 0; ``tokens[rank]`` no-grad forwards; step 1 (abandoned if the ranks disagreed, or ``step_1=False``:
    not run, its step abandoned); step 2. Returns the
    error this rank raised (None), the parameter all-gathers counted from the forwards to the error, the eval
    forwards' per-pass counts, the losses and the parameters."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = SameLayers()
    engine = training_engine(model, zero3_config(bucket=LAYER, reuse=DEFAULT, max_live=cap))
    losses = [train(engine, 0)]
    deepspeed_zero3.reset_zero3_stats(engine)
    error = None
    with parameter_gathers() as counted:
        try:
            with torch.no_grad():
                for token in range(tokens[rank]):
                    engine(batch(100 + token, rank))
            if step_1:
                losses.append(train(engine, 1))
            else:
                deepspeed_zero3.abandon_step(engine)
        except deepspeed_zero3.RanksInDifferentPasses as raised:
            error = raised
            deepspeed_zero3.abandon_step(engine)
    passes = [(p["kind"], p["allgather_calls"], p["pass_checks"], p["aborted"])
              for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]]
    losses.append(train(engine, 2))
    params = gathered_copies(model.parameters())
    engine.destroy()
    return error, counted["calls"], passes, losses, params


def test_under_a_cap_every_rank_raises_before_any_mismatched_gather():
    rank = torch.distributed.get_rank()
    error, gathers, passes, losses, params = run(TOKENS, cap=MODEL // 2)
    assert isinstance(error, deepspeed_zero3.RanksInDifferentPasses)
    message = str(error)
    # Step 0's forward and backward were gathering passes 0 and 1, the six no-grad forwards 2..7.
    assert ("rank 0: forward pass, gathering pass 8" in message
            and "rank 1: eval_forward pass, gathering pass 8" in message), message
    assert "synced_gpus=True" in message and "abandon_step" in message
    # Under the cap the first no-grad forward gathers all 6 layers (step 0's backward released everything) and
    # keeps the first 3 for the next (the cap), which gathers the other 3, one all-gather per layer; each after one
    # exchange of 3 integers. The pass that found the other rank elsewhere exchanged and gathered nothing.
    evals = [("eval_forward", 6, 1, False)] + [("eval_forward", 3, 1, False)] * 5
    last = "forward" if rank == 0 else "eval_forward"
    assert passes == evals + [(last, 0, 1, True)]
    # At torch.distributed, the same on both ranks and equal to the counts: no gather left the agreed passes.
    assert gathers == 6 + 5 * 3
    # The step after the error trains as a step would have without the disagreement.
    _, _, _, clean_losses, clean_params = run({0: 6, 1: 6}, cap=MODEL // 2, step_1=False)
    assert losses == clean_losses
    assert all(torch.equal(a, b) for a, b in zip(params, clean_params, strict=True))


def test_at_the_default_keys_ranks_that_stop_apart_go_on_as_before():
    """The first no-grad forward gathers the model (one exchange) and keeps it all: the other tokens, rank 1's
    extra ones included, gather nothing and exchange nothing, and both ranks train on, to the losses and
    parameters of a run where both stopped at token 6."""
    error, _, passes, losses, params = run(TOKENS)
    assert error is None
    rank = torch.distributed.get_rank()
    evals = [p for p in passes if p[0] == "eval_forward"]
    assert evals == [("eval_forward", 6, 1, False)] + [("eval_forward", 0, 0, False)] * (TOKENS[rank] - 1)
    _, _, _, synced_losses, synced_params = run({0: 6, 1: 6})
    assert losses == synced_losses
    assert all(torch.equal(a, b) for a, b in zip(params, synced_params, strict=True))


@pytest.mark.parametrize("cap", [None, MODEL // 2])
def test_a_gathering_pass_costs_one_exchange(cap):
    """Exact: one pass check per pass that gathers, none for one that does not."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = training_engine(SameLayers(), zero3_config(bucket=LAYER, reuse=0, max_live=cap))
    for step in range(2):
        train(engine, step)
    with torch.no_grad():
        engine(batch(100, rank))
    records = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert [(p["kind"], p["pass_checks"]) for p in records] == [("forward", 1), ("backward", 1)] * 2 + [
        ("eval_forward", 1)]
    assert all(p["allgather_calls"] > 0 for p in records)
    engine.destroy()
