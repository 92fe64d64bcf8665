"""An external parameter read inside an activation checkpoint, and a forward that rank 0 alone runs inside
``GatheredParameters``: the ranks stay in step. The external-read window is written by the getter mid-pass; the
solo forward touches it on rank 0 only, so any difference it made would show as per-rank all-gather counts that
differ, or as losses and parameters that differ from a run without the solo forward ([Note: silent passes])."""

import pytest
import torch
import torch.utils.checkpoint

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.runtime.zero import capabilities
from deepspeed_zero3.testing.engines import batch, gathered_copies, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import ReadsAhead


class CheckpointedExternalRead(torch.nn.Module):
    """The root reads ``inner.c.weight`` (an external parameter of the root) inside a non-reentrant checkpoint,
    so the backward's recompute reads it again; a tied read, ``inner.a.weight`` by a second use, comes after."""

    def __init__(self):
        super().__init__()
        self.inner = ReadsAhead()
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.out(h @ self.inner.a.weight)


@pytest.mark.skipif(capabilities.GATHERED_CONTEXT_DEPTH_ATTR is None,
                    reason="this deepspeed release's GatheredParameters does not mark what it holds (from 0.19.4): a "
                    "forward on one rank under it releases parameters, and the order check stops every rank")
@pytest.mark.parametrize("solo_kind", ["no_grad", "grad", "grad_checkpointed"])
def test_solo_forward_after_checkpointed_external_reads_keeps_ranks_in_step(solo_kind):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def run(solo: bool):
        torch.manual_seed(0)
        model = CheckpointedExternalRead()
        engine = training_engine(model, zero3_config(bucket=300, reuse=0))
        losses = []
        for step in range(3):
            loss = mse_loss(engine(batch(step, rank)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if solo:
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    if rank == 0:
                        with torch.set_grad_enabled(solo_kind != "no_grad"):
                            x = batch(200 + step, 0)
                            if solo_kind == "grad_checkpointed":
                                torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum()
                            else:
                                model(x).sum()
        counts = [(p["kind"], p["allgather_calls"], p["allgather_numel"])
                  for p in deepspeed_zero3.get_zero3_stats(engine)["passes"] if p["allgather_calls"] > 0]
        params = gathered_copies(model.parameters())
        engine.destroy()
        return losses, params, counts

    losses, params, counts = run(solo=True)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, counts)
    assert all(other == everyone[0] for other in everyone), everyone
    expected_losses, expected_params, expected_counts = run(solo=False)
    assert counts == expected_counts
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
