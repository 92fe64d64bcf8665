"""Upstream's module-level names in a real engine: a parameter read outside its own module's forward is gathered
by ZeROOrderedDict's getter, which says so through ``parameter_offload.print_rank_0`` as upstream's does."""

import torch
from torch import nn

from deepspeed.runtime.zero import parameter_offload

from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config


class ReadsAnotherModulesWeight(nn.Module):
    """``head`` multiplies by ``body``'s weight, which its own fetch does not cover the first time."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.body.weight))


def test_getter_gather_goes_through_parameter_offload_print_rank_0(monkeypatch):
    assert parameter_offload.__name__ == "deepspeed_zero3.runtime.zero.parameter_offload"
    printed = []
    monkeypatch.setattr(parameter_offload, "print_rank_0", lambda message, **kwargs: printed.append(message))
    torch.manual_seed(0)
    model = ReadsAnotherModulesWeight()
    engine = training_engine(model, zero3_config(bucket=0, reuse=0))
    rank = torch.distributed.get_rank()
    body_weight = model.body.weight
    for step in range(3):
        train_step(engine, batch(step, rank))
    # The first forward gathers it in the getter and registers it with the root; later fetches cover it.
    assert printed == [f"Registering external parameter from getter weight ds_id = {body_weight.ds_id}"]
    assert [p for _, p in model.ds_external_parameters()] == [body_weight]
    engine.destroy()
