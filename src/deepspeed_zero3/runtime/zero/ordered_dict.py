"""``module._parameters`` replacement that gathers a parameter read outside its own module's forward.

A parameter read during a forward while partitioned belongs to another module
(a tied embedding read by the LM head, say). It is gathered on the spot and
registered as an external parameter of the module now running, so that from the
next pass on that module's fetch covers it.

[Note: a parameter read while in flight]
Upstream's getter acts on ``NOT_AVAILABLE`` parameters only: read in a forward while partitioned, a
parameter is gathered and registered as an external parameter of the module running, whose fetches cover
it from then on (in the backward too, where autograd needs it again). Upstream's first pass prefetches
nothing, so every such read of a first pass finds the parameter partitioned. Ours replays a guess from the
first pass ([Note: first-pass prediction]), so a module that reads another module's parameter before that
module runs (``self.c(self.a(x) @ self.c.weight.t())``) finds it already in flight or gathered ahead. It
would get an ``INFLIGHT`` parameter's empty placeholder ("size of tensor a (0) must match"), and, never
registered, the backward would find it released. So a parameter read while gathered or in flight that no
running fetch holds (no ``ds_active_sub_modules``; not persistent, not held by ``GatheredParameters``) is
registered as external as if it had been partitioned, and a gather in flight is completed through the
coordinator that started it (which also makes the stream wait for it).
"""

import sys
from collections import OrderedDict

import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, register_external_parameter
from deepspeed.utils.logging import logger

from deepspeed_zero3.runtime.zero import capabilities
from deepspeed_zero3.runtime.zero.residency import releasable
from deepspeed_zero3.runtime.zero.hooks import FWD_MODULE_STACK
from deepspeed_zero3.runtime.zero.registry_lookup import REGISTRY_ATTR, find_registry


class ZeROOrderedDict(OrderedDict):

    def __init__(self, parent_module, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._in_forward = False

    def __reduce__(self):
        constructor, _, *rest = super().__reduce__()
        return (constructor, (self._parent_module, )) + tuple(rest)

    def __getitem__(self, key):
        param = super().__getitem__(key)
        if param is None or torch.compiler.is_compiling():
            return param
        if not hasattr(param, "ds_status"):
            if self._in_forward and not getattr(param, "_zero3_unmanaged_warned", False):
                warn_unmanaged(self._parent_module, key, param)
            return param
        # The engine flips _in_forward on every module's dict around its forward.
        if not self._parent_module._parameters._in_forward:
            return param

        # DeepCompile's eager fallback tracks parameter reads itself, where the release has one ([Note: release
        # capabilities]).
        fallback = capabilities.active_eager_fallback()
        if (fallback is not None and param.ds_status == ZeroParamStatus.AVAILABLE
                and not capabilities.is_dynamo_guard_evaluation()):
            capabilities.record_param_access(fallback, param)

        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            if fallback is None and _gathered_ahead_unclaimed(param):
                # [Note: a parameter read while in flight]
                if FWD_MODULE_STACK:
                    register_external_parameter(FWD_MODULE_STACK[-1], param)
                if param.ds_status == ZeroParamStatus.INFLIGHT:
                    _complete_gather(self._parent_module, param)
        else:
            if fallback is None:
                if FWD_MODULE_STACK:
                    register_external_parameter(FWD_MODULE_STACK[-1], param)
                _gather_read(self._parent_module, param)
            elif capabilities.is_dynamo_guard_evaluation():
                # A guard reads identity and metadata only; gathering would hold a full buffer for nothing.
                fallback.record_guard_suppressed_param(param)
                return param
            else:
                param.all_gather()
                fallback.record_gathered_param(param)
            _announce_getter_gather(key, param)
        if FWD_MODULE_STACK and fallback is None:
            _note_external_read(FWD_MODULE_STACK[-1], param)
        return param


def _note_external_read(reader, param) -> None:
    """Tell ``reader``'s coordinator that it read ``param``, if that is one of its external parameters, and how
    ([Note: release at last use in a recompute], recompute.py)."""
    if id(param) not in reader.__dict__.get("_external_params", ()):
        return
    registry = reader.__dict__.get(REGISTRY_ATTR)
    if registry is not None:
        registry.coordinator.note_external_read(reader, param)


def _gathered_ahead_unclaimed(param) -> bool:
    """[Note: a parameter read while in flight]: no running fetch holds ``param``."""
    return not param.ds_persist and releasable(param)


def _coordinator_for(module, param):
    """The coordinator managing ``module`` or, for a child of a z3 leaf module (which has no hooks of its own),
    that leaf; None if no deepspeed-zero3 engine manages either."""
    owner = module if REGISTRY_ATTR in module.__dict__ else getattr(param, "ds_z3_leaf_module", None)
    registry = find_registry(owner) if owner is not None else None
    return registry.coordinator if registry is not None else None


def _gather_read(module, param) -> None:
    """Gather a partitioned ``param`` that ``module``'s dict hands out, counted by its coordinator ([Note:
    residency]); with none, as upstream does."""
    coordinator = _coordinator_for(module, param)
    if coordinator is not None:
        coordinator.gather_read(param)
    else:
        param.all_gather()


def _complete_gather(module, param) -> None:
    """Complete ``param``'s gather in flight ([Note: a parameter read while in flight]), found from its module or,
    for a child of a z3 leaf module (which has no hooks of its own), from that leaf."""
    coordinator = _coordinator_for(module, param)
    if coordinator is None:
        raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} of "
                           f"{type(module).__name__} is INFLIGHT, and no deepspeed-zero3 engine manages that module "
                           "or a z3 leaf module above it to complete the gather")
    coordinator.complete_gather(param)


def _announce_getter_gather(key, param) -> None:
    """Upstream's debug line for a gather in the getter, through ``parameter_offload.print_rank_0``.

    Looked up on that module when called, so patching the name there has the effect it has upstream
    ([Note: upstream's module names] in upstream_names.py).
    """
    offload = sys.modules.get("deepspeed_zero3.runtime.zero.parameter_offload")
    if offload is not None:
        offload.print_rank_0(f"Registering external parameter from getter {key} ds_id = {param.ds_id}", force=False)


def warn_unmanaged(module, key, param) -> None:
    """A module attached after ``deepspeed.initialize`` runs as plain PyTorch: say so once per parameter.

    Its parameters are ordinary tensors, whole on every rank, and the engine's optimizer never saw them. That
    is what PyTorch does for a module added after its optimizer was built; ZeRO-3 adds that they are not
    sharded either.
    """
    param._zero3_unmanaged_warned = True
    logger.warning(f"deepspeed-zero3: parameter {key!r} of {type(module).__name__} was added after "
                   f"deepspeed.initialize: it stays an ordinary tensor, whole on every rank (not sharded), and the "
                   f"engine's optimizer does not train it. To shard and train it, attach the module before "
                   f"deepspeed.initialize (or build a new engine over the model).")


def _wrap_parameters(module):
    wrapped = ZeROOrderedDict(parent_module=module)
    for key, param in module._parameters.items():
        wrapped[key] = param
    return wrapped


def inject_zero_ordered_dicts(root):
    """Give every module of ``root`` a ZeROOrderedDict, keeping the original container for un-injection."""
    for module in root.modules():
        ensure_zero_ordered_dict(module)


def ensure_zero_ordered_dict(module):
    """Wrap ``module._parameters`` in a ZeROOrderedDict unless it already is one (idempotent).

    torch >= 2.5 makes ``_parameters`` a plain dict, which cannot carry ``_in_forward``; modules
    attached after ``deepspeed.initialize`` still need the wrapper before the engine's forward.
    """
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = _wrap_parameters(module)
