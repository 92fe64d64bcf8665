"""Real nn.Parameters and nn.Modules carrying the ZeRO-3 attributes the runtime reads, without partitioning."""

import torch
from torch import nn

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def zparam(ds_id, numel, status=ZeroParamStatus.NOT_AVAILABLE, persist=False):
    param = nn.Parameter(torch.zeros(numel))
    param.ds_id = ds_id
    param.ds_numel = numel
    param.ds_status = status
    param.ds_persist = persist
    param.ds_active_sub_modules = set()
    return param


class ZModule(nn.Module):
    """A module that can run (its class has a forward): guesses leave out the ones that cannot."""

    def forward(self, *args):
        return args


def zmodule(ds_id, *params, external=(), container=False):
    """A module owning ``params`` (registered in the order given) and fetching ``external`` as external params;
    ``container``: one without a forward of its own, as ``nn.ModuleList``."""
    module = nn.Module() if container else ZModule()
    module.ds_id = ds_id
    for index, param in enumerate(params):
        module.register_parameter(f"p{index}", param)
    if external:
        module.ds_external_parameters = lambda: [(f"ext{i}", p) for i, p in enumerate(external)]
    return module
