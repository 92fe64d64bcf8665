"""[Note: release at last use in a recompute] on a LoRA model with gradient checkpointing: exact counts for ours.

tests/parity/scenarios_lora.py's ``LoRADecoder``: 3 checkpointed blocks, each a frozen norm (256) and two LoRA
projections (a frozen base Linear of 16,512 and rank-4 adapters of 512 + 512), a frozen embedding, a trainable
head; prefetching off and reuse distance 0, so what is gathered is what a module holds. Per backward (the meter
reads the gathered non-persistent numel after each fetch; the all-gathered numel counts what both runtimes ask
``all_gather_coalesced`` to gather):

=================  ==========================  ==========================
checkpointing      ours: peak / all-gathered   upstream: peak / all-gathered
=================  ==========================  ==========================
non-reentrant      35,328 / 106,113            34,304 / 193,793
reentrant          35,328 / 106,113            100,352 / 112,257
=================  ==========================  ==========================

Ours peaks at one block (both bases, four adapters, the norm) in either mode and gathers each parameter once
(all but the embedding, which has no backward). Upstream's non-reentrant backward releases the recomputed adapters after the
recompute and gathers them again for their backward (1.83 times our traffic, for a peak 1,024 lower); reentrant,
it keeps most of what each recompute gathered until the whole backward ends, so its peak grows block by block. Upstream's figures are what the parity scenarios ``lora_checkpointing_*`` record for it with the same
instruments (``backward_peak_live_numel``, ``backward_gathered_numel``), where losses and parameters are compared
with upstream bitwise.
"""

import sys
from pathlib import Path

import pytest
import torch

import deepspeed_zero3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from scenarios_lora import BASE_NUMEL, STEPS, build, tokens, train  # noqa: E402

BLOCK_NUMEL = 256 + 2 * (BASE_NUMEL + 512 + 512)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_lora_checkpointing_backward_holds_one_block_and_gathers_each_parameter_once(use_reentrant):
    model, engine = build(use_reentrant)
    losses, peaks, gathered = train(engine, model, STEPS, torch.distributed.get_rank())
    assert BLOCK_NUMEL == 35_328
    assert peaks == [BLOCK_NUMEL] * STEPS, peaks
    # Every parameter once, but the embedding's: fed token ids, it has no backward.
    used = sum(p.ds_numel for p in model.parameters()) - model.embed.weight.ds_numel
    assert gathered == [used] * STEPS == [106_113] * STEPS, gathered
    backward = [p for p in deepspeed_zero3.get_zero3_stats(engine)["passes"] if p["kind"] == "backward"]
    assert [p["allgather_numel"] for p in backward] == gathered
    for name, param in model.named_parameters():
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
    engine.destroy()


def test_a_base_projection_without_input_grad_is_released_at_its_recompute():
    """Non-reentrant, the first block's input (the frozen embedding's output) needs no grad: its first base
    projection has no backward, so it is released as soon as its recompute ends. The second one's input carries the
    adapters' gradient: it has a backward, which needs its weight, so it stays gathered for it."""
    model, engine = build(use_reentrant=False)
    first = model.blocks[0]
    seen = []

    def after_recompute(module, args, output):
        if torch._C._current_graph_task_id() != -1:
            seen.append((module.weight.ds_status, module.bias.ds_status))

    handles = [first.attn.base.register_forward_hook(after_recompute, prepend=False),
               first.mlp.base.register_forward_hook(after_recompute, prepend=False)]
    engine.backward(engine(tokens(0, torch.distributed.get_rank())))
    # Our release hook ran before these (registered first).
    assert seen == [(ZeroParamStatus.NOT_AVAILABLE, ) * 2, (ZeroParamStatus.AVAILABLE, ) * 2], seen
    for handle in handles:
        handle.remove()
    engine.destroy()
