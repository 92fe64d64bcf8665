"""An external parameter read inside an activation checkpoint, and a forward that rank 0 alone runs inside
``GatheredParameters``: the ranks stay in step. The external-read window is written by the getter mid-pass; the
solo forward touches it on rank 0 only, so any difference it made would show as per-rank all-gather counts that
differ, or as losses and parameters that differ from a run without the solo forward ([Note: silent passes])."""

import pytest
import torch
import torch.utils.checkpoint

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.runtime.zero.registry_lookup import coordinator_of
from deepspeed_zero3.testing.engines import batch, gathered_copies, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import ReadsAhead


class CheckpointedExternalRead(torch.nn.Module):
    """``inner`` reads ``inner.c.weight`` before ``c`` runs (an external parameter of ``inner``) inside a
    non-reentrant checkpoint, so the backward's recompute reads it again; a tied read, ``inner.a.weight`` by a
    second use, comes after. With ``checkpointed`` off, the same read may save the weight by reference."""

    def __init__(self):
        super().__init__()
        self.inner = ReadsAhead()
        self.out = torch.nn.Linear(16, 16)
        self.checkpointed = True

    def forward(self, x):
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        else:
            h = self.inner(x)
        return self.out(h @ self.inner.a.weight)


@pytest.mark.parametrize("solo_kind", ["no_grad", "grad", "grad_checkpointed", "grad_by_reference"])
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
                reads = coordinator_of(engine).external_reads
                committed = (dict(reads.by_reference), reads.backward_since)
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    if rank == 0:
                        with torch.set_grad_enabled(solo_kind != "no_grad"):
                            x = batch(200 + step, 0)
                            if solo_kind == "grad_checkpointed":
                                torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum()
                            else:
                                # grad_by_reference: the solo read is one the training passes never make
                                model.checkpointed = solo_kind != "grad_by_reference"
                                model(x).sum()
                                model.checkpointed = True
                # The solo forward is silent: the reads it made are not committed ([Note: silent passes]).
                assert (dict(reads.by_reference), reads.backward_since) == committed
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


class Stop(Exception):
    pass


def test_an_aborted_forward_commits_none_of_its_external_reads():
    """A forward that raises after reading an external parameter by reference leaves the committed reads as they
    were, so the next backward claims what it would have claimed without it, and the ranks stay in step."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = CheckpointedExternalRead()
    engine = training_engine(model, zero3_config(bucket=300, reuse=0))
    engine.backward(mse_loss(engine(batch(0, rank))))
    engine.step()
    reads = coordinator_of(engine).external_reads
    committed = (dict(reads.by_reference), reads.backward_since)

    def stop(module, args):
        raise Stop()

    handle = model.out.register_forward_pre_hook(stop)
    model.checkpointed = False
    with pytest.raises(Stop):
        engine(batch(1, rank))
    handle.remove()
    model.checkpointed = True
    assert (dict(reads.by_reference), reads.backward_since) == committed
    engine.backward(mse_loss(engine(batch(2, rank))))
    engine.step()
    counts = [(p["kind"], p["allgather_calls"], p["allgather_numel"], p["aborted"])
              for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]]
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, counts)
    assert all(other == everyone[0] for other in everyone), everyone
    assert [c[3] for c in counts] == [False, False, True, False, False]
    engine.destroy()
