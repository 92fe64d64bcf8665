"""Which ZeRO parameters a submodule fetches: its own, its external ones, and, for a z3 leaf, its subtree's.

[Note: cached parameter lists]
A replayed pass reuses the parameter list its trace recorded for a step (``PassTrace.params_at``) instead
of calling ``fetch_params`` on every fetch, and a release covers the list its module's fetch took, unchecked
(what a fetch gathered is what its release looks at), unless the module has external parameters (a
non-empty ``_external_params``: initialize gives every module an empty one), which its forward may add to.
The list is only reused while the module's signature (``params_signature``) equals the one recorded with
it: the identities of its own parameters (a parameter assigned after ``initialize`` changes them, and the
fetch then raises ``raise_for_unconverted``'s error as before), and the keys of its ``_external_params``
(upstream keys them by ``id``; an external parameter found during a pass changes them). Identities are
safe to compare because whoever holds a signature also holds the parameters it was taken from, so none of
those ids can be reused by a new object.
"""

import itertools
from typing import Dict, Iterable, List, Optional

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


def gathers_anything(module: Module) -> bool:
    """Whether a fetch of ``module`` may gather: it covers a parameter that is not persistent (a module with none,
    or only persistent ones, is neither gathered nor released, wherever it runs)."""
    return any(not getattr(p, "ds_persist", False) for p in fetch_params(module, strict=False))


def params_signature(module: Module) -> Optional[tuple]:
    """What ``fetch_params(module)`` depends on, in a form that is cheap to build and compare; None when the
    module's parameters cannot be told apart this cheaply (a z3 leaf, whose whole subtree counts, or external
    parameters that do not come from ``register_external_parameter``): [Note: cached parameter lists]."""
    state = module.__dict__
    if state.get("_z3_leaf") or _class_opts_out(type(module)):
        return None
    own = tuple(map(id, state["_parameters"].values()))
    external = state.get("_external_params")
    if external is None:
        return None if "ds_external_parameters" in state else own
    return own, tuple(external)


_CLASS_OPTS_OUT: Dict[type, bool] = {}


def _class_opts_out(cls: type) -> bool:
    """A class that declares ``_z3_leaf`` or ``ds_external_parameters`` itself, or has its own
    ``named_parameters``: its modules are left to ``fetch_params``."""
    opts_out = _CLASS_OPTS_OUT.get(cls)
    if opts_out is None:
        opts_out = _CLASS_OPTS_OUT[cls] = (hasattr(cls, "_z3_leaf") or hasattr(cls, "ds_external_parameters")
                                           or cls.named_parameters is not Module.named_parameters)
    return opts_out


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
