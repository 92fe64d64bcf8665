"""The ordered all-gathers of one Model B training step, in FSDP2's style: every collective as (pass, the module
whose fetch issued it, demand or prefetch, the modules whose parameters it carries).

Model B (testing/models.py), bucket 20,000, reuse distance 0, two ranks; the step recorded is the third, when
both passes replay their traces. Forward: the root's fetch (it owns no parameter) primes the window, ``inp`` and
block 0's up (17,728) and the module that crosses the bucket's line, block 0's down; from then on each module's
fetch prefetches the module two ahead of it, one projection (16,640 or 16,448) per collective. The forward keeps
the head and the last down projection for the backward ([Note: budgeted keeping]), so the backward's priming
prefetch, at the root's backward fetch, starts at the last up projection, and again each fetch prefetches two
modules ahead. 23 collectives, every one a prefetch: nothing is fetched on demand.
"""

import torch

import deepspeed_zero3
from deepspeed_zero3.runtime.zero.registry_lookup import coordinator_of
from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

ROOT = "(root)"
ORDER = ["inp"] + [f"blocks.{i}.{part}" for i in range(6) for part in ("up", "down")] + ["head"]
REVERSED = ORDER[::-1]
EXPECTED_FORWARD = ([("forward", ROOT, "prefetch", ["inp", "blocks.0.up", "blocks.0.down"])]
                    + [("forward", ORDER[i], "prefetch", [ORDER[i + 2]]) for i in range(1, len(ORDER) - 2)])
EXPECTED_BACKWARD = ([("backward", ROOT, "prefetch", ["blocks.5.up", "blocks.4.down"])]
                     + [("backward", REVERSED[i], "prefetch", [REVERSED[i + 2]]) for i in range(2, len(REVERSED) - 2)])


def record_gathers(engine, model):
    """Wrap the coordinator's fetch, gather and gatherer so that each collective it issues is recorded; the
    collectives themselves run unchanged."""
    coordinator = coordinator_of(engine)
    owner = {id(param): name.rsplit(".", 1)[0] for name, param in model.named_parameters()}
    module_name = {id(module): name or ROOT for name, module in model.named_modules()}
    events, state = [], {"module": "(no fetch)", "prefetch": None}
    fetch, gather, submit = coordinator.fetch_sub_module, coordinator._gather, coordinator.gatherer.submit

    def recording_fetch(module, forward):
        state["module"] = module_name.get(id(module), "?")
        try:
            return fetch(module, forward)
        finally:
            state["module"] = "(no fetch)"

    def recording_gather(running, params, prefetch, forward=True):
        state["prefetch"] = prefetch
        return gather(running, params, prefetch, forward)

    def recording_submit(params, timed=None, before=None):
        groups = submit(params, timed=timed, before=before)
        for group in groups:
            modules = list(dict.fromkeys(owner[id(p)] for p in group))
            events.append((coordinator.running.kind.value, state["module"],
                           "prefetch" if state["prefetch"] else "demand", modules))
        return groups

    coordinator.fetch_sub_module = recording_fetch
    coordinator._gather = recording_gather
    coordinator.gatherer.submit = recording_submit
    return events


def test_one_model_b_step_gathers_in_this_order():
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    for step in range(2):
        train_step(engine, batch(step, rank))
    events = record_gathers(engine, model)
    train_step(engine, batch(2, rank))
    forward = [e for e in events if e[0] == "forward"]
    backward = [e for e in events if e[0] == "backward"]
    assert forward == EXPECTED_FORWARD, forward
    assert backward == EXPECTED_BACKWARD, backward
    last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-2:]
    assert [p["allgather_calls"] for p in last] == [len(forward), len(backward)] == [12, 11]
    engine.destroy()
