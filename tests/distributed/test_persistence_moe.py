"""Persistent parameters stay gathered in forward and backward whether or not a pass replays a trace.

``stage3_param_persistence_threshold`` (DeepSpeed's default, 100,000) makes the 15 small parameters of
tests/parity/scenarios_moe.py's MoENet persistent. The first forward gathers them; from then on stage 3 gathers
them once per optimizer step (its ``_post_step``, both runtimes), and the parameter runtime never releases them,
so no forward or backward gathers one again:

* MoE block as a z3 leaf: the hooked module order is the same every step whatever the routing (the traces
  replay from the second step on);
* experts as z3 leaves, run only when routed to: the module order follows the routing, so passes whose order
  is new record a trace instead of replaying one. Upstream's single forward+backward trace never completes
  on this model, and upstream then releases persistent parameters after each module like any other (its
  ``release_sub_module`` filters ``ds_persist`` only from a complete trace): it gathers them again in the
  backward of every step whose order differs from the one before (the parity records hold its counts).

The meter (``PersistentGatherCount``) is the parity scenarios' instrument, the same for both runtimes; losses,
parameters and the per-optimizer-step gathers are compared with upstream bitwise by those scenarios.
"""

import sys
from pathlib import Path

import torch

import deepspeed_zero3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from scenarios_moe import PERSISTENT, Expert, MoEBlock, build, train_steps  # noqa: E402

STEPS = 5
# What a step leaves gathered: the persistent parameters (stage 3's _post_step), nothing else.
FIRST_STEP = {"forward": PERSISTENT, "backward": 0, "step": PERSISTENT}
LATER_STEP = {"forward": 0, "backward": 0, "step": PERSISTENT}


def passes(engine):
    return [(p["kind"], p["trace_records"], p["trace_mismatches"], p["trace_switches"])
            for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]]


def check_gathered_state(model):
    for name, param in model.named_parameters():
        expected = ZeroParamStatus.AVAILABLE if param.ds_persist else ZeroParamStatus.NOT_AVAILABLE
        assert param.ds_status == expected, (name, param.ds_status)


def test_moe_leaf_block_persistent_parameters_gathered_once():
    model, engine, persistent, meter = build(MoEBlock)
    rank = torch.distributed.get_rank()
    losses, gathers, routed = train_steps(engine, model, meter, STEPS, rank)
    assert gathers == [FIRST_STEP] + [LATER_STEP] * (STEPS - 1), gathers
    check_gathered_state(model)
    # Routing is data-dependent (this rank's batches): the experts that ran differ from step to step.
    assert len({tuple(r) for r in routed}) > 1, routed
    # The hooked order does not depend on it: one trace per kind, replayed from the second step on.
    assert passes(engine) == [("forward", 1, 0, 0), ("backward", 1, 0, 0)] + [("forward", 0, 0, 0),
                                                                               ("backward", 0, 0, 0)] * (STEPS - 1)
    engine.destroy()


def test_moe_expert_leaves_persistent_parameters_gathered_once_without_a_complete_trace():
    model, engine, persistent, meter = build(Expert)
    losses, gathers, routed = train_steps(engine, model, meter, STEPS, 0)  # every rank: rank 0's batches
    # The routing of batch(step, 0): the expert order changes every step, and with it the hooked module order.
    assert routed == [[1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [0, 3], [1, 2, 3]], routed
    # The first forward gathers all 15, expert 0's two biases included though expert 0 does not run: the first
    # forward replays the registration-order guess, which prefetches every expert ([Note: first-pass prediction]).
    assert gathers == [FIRST_STEP] + [LATER_STEP] * (STEPS - 1), gathers
    check_gathered_state(model)
    # (kind, trace records, mismatches, switches) per pass. Steps 0-3 each run an order not seen before: the
    # forward leaves what it replays (step 0: the guess, which expects expert 0) and records its order; the
    # backward follows its forward reversed, a guess (never cached), and records. Step 4 runs step 0's order
    # again: its forward switches to step 0's trace, its backward replays step 0's backward.
    assert passes(engine) == [("forward", 1, 1, 0), ("backward", 1, 0, 0)] * 4 + [("forward", 0, 0, 1),
                                                                                  ("backward", 0, 0, 0)]
    engine.destroy()
