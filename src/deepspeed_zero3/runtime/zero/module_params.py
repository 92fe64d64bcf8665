"""Which ZeRO parameters a submodule fetches: its own, its external ones, and, for a z3 leaf, its subtree's."""

import itertools
from typing import Iterable, List

from torch.nn import Module, Parameter

from deepspeed.utils import z3_leaf_module


def named_fetch_params(module: Module, recurse: bool = False):
    external = module.ds_external_parameters() if hasattr(module, "ds_external_parameters") else ()
    return itertools.chain(module.named_parameters(recurse=recurse), external)


def iter_params(module: Module, recurse: bool = False) -> Iterable[Parameter]:
    """The parameters a fetch of ``module`` covers (upstream's name and signature)."""
    return (param for _, param in named_fetch_params(module, recurse))


def fetch_params(module: Module) -> List[Parameter]:
    """The parameters one fetch of ``module`` gathers, in a rank-independent order (by ``ds_id``)."""
    return sorted(set(iter_params(module, recurse=z3_leaf_module(module))), key=lambda p: p.ds_id)
