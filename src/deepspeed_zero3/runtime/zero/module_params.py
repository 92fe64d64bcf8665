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


def fetch_params(module: Module, strict: bool = True) -> List[Parameter]:
    """The parameters one fetch of ``module`` gathers, in a rank-independent order (by ``ds_id``).

    ``strict=False`` (releases) skips plain parameters instead of raising: the release that follows a refused
    fetch must not raise the same error again from an always-called hook.
    """
    params = set(iter_params(module, recurse=z3_leaf_module(module)))
    try:
        return sorted(params, key=lambda p: p.ds_id)
    except AttributeError:
        if strict:
            raise_for_unconverted(module)
            raise
        return sorted((p for p in params if hasattr(p, "ds_id")), key=lambda p: p.ds_id)


def raise_for_unconverted(module: Module) -> None:
    """A managed module holds a plain parameter: one assigned after ``deepspeed.initialize``. Say what to do.

    Its partitioned predecessor, if any, is the one the optimizer holds; gathering the new tensor in its place
    would train nothing and silently diverge the ranks, so this is an error, not a fallback.
    """
    recurse = z3_leaf_module(module)
    for name, param in named_fetch_params(module, recurse):
        if not hasattr(param, "ds_id"):
            raise RuntimeError(
                f"deepspeed-zero3: parameter {name!r} of module {type(module).__name__} (ds_id={module.ds_id}) is not "
                f"a ZeRO-3 parameter: it was assigned after deepspeed.initialize (shape {tuple(param.shape)}). "
                f"ZeRO-3 partitions parameters when the engine is built, and the optimizer holds the ones it "
                f"partitioned. To change values, write into the existing parameter on every rank: `with "
                f"deepspeed.zero.GatheredParameters(module.{name}, modifier_rank=0), torch.no_grad(): "
                f"module.{name}.copy_(new)`; to "
                f"change the model, make the change before deepspeed.initialize.")
