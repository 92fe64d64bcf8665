"""The ZeRO-3 hooks on each module, routed to the coordinator of the module's registry.

Per module, the points upstream hooks:
  forward     a pre-forward hook fetches the module's parameters; a forward hook (always called, also
              when the forward raises) releases them;
  backward    a forward hook wraps the outputs, so that the gradient reaching them fetches the
              parameters (pre-backward); a pre-forward hook wraps the inputs and counts those that
              will receive a gradient, the last of which releases them (post-backward).
Per root module, two more mark where a forward pass begins and ends.

The hooks own their own state: the stack of modules whose forward is running, and each module's count
of input gradients still to come. Nothing here reads ``nn.Module.training``. Every hook and backward
callback is ``eager_only`` ([Note: what Dynamo may trace] in ``eager.py``).
"""

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Tuple

import torch
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from deepspeed.runtime.zero.partition_parameters import register_external_parameter, unregister_external_parameter
from deepspeed.runtime.zero.utils import apply_to_tensors_only, is_zero_param

from deepspeed_zero3.runtime.zero.eager import eager_only
from deepspeed_zero3.runtime.zero.recompute import carries_grad, in_autograd_engine

if TYPE_CHECKING:
    from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

# Modules whose forward is running, innermost last (upstream's name). The engine's root is at the bottom.
FWD_MODULE_STACK: List[Module] = []


class BackwardHook(torch.autograd.Function):
    """Identity on a tensor whose backward calls ``callback(module)`` when the tensor's gradient arrives.

    On a module output, the callback fetches the module's parameters before its backward (pre-backward);
    on a module input, it counts the input gradients, the last of which ends the module's backward.
    """

    @staticmethod
    def forward(ctx, callback, module, tensor):
        ctx.callback = callback
        ctx.module = module
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.callback(ctx.module)
        return None, None, grad


def _unexpected_type_warning(value):
    return (f"deepspeed-zero3: a module input or output of type {type(value).__name__} hides its tensors from the "
            "ZeRO-3 backward hooks; its parameters are then fetched on demand in backward and released at its end.")


def handle_is_live(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


@dataclass(frozen=True)
class ModuleHooks:
    """The handles of one module's hooks, in upstream's two groups (``forward_hooks``, ``backward_hooks``)."""
    forward: Tuple[RemovableHandle, ...]
    backward: Tuple[RemovableHandle, ...]

    def all(self) -> Tuple[RemovableHandle, ...]:
        return self.forward + self.backward

    def live(self) -> bool:
        return all(handle_is_live(h) for h in self.all())


class HookRouter:
    """Installs the hooks and turns hook events into coordinator calls."""

    def __init__(self, coordinator: "PartitionedParameterCoordinator"):
        self.coordinator = coordinator

    # ---------------------------------------------------------------- installation

    def install_module_hooks(self, module: Module) -> ModuleHooks:
        return ModuleHooks(
            forward=(module.register_forward_pre_hook(self._pre_forward),
                     module.register_forward_hook(self._post_forward, always_call=True)),
            backward=(module.register_forward_hook(self._wrap_outputs),
                      module.register_forward_pre_hook(self._wrap_inputs)),
        )

    def install_root_hooks(self, root: Module) -> Tuple[RemovableHandle, ...]:
        return (
            root.register_forward_pre_hook(self._enter_root, prepend=True),
            root.register_forward_hook(self._exit_root, always_call=True),
        )

    # ---------------------------------------------------------------- pass boundaries

    @eager_only
    def _enter_root(self, module, args):
        self.coordinator.enter_root_forward()

    @eager_only
    def _exit_root(self, module, args, output):
        # always_call hooks also run when the forward raised; then an exception is being handled.
        self.coordinator.exit_root_forward(aborted=sys.exc_info()[0] is not None)

    # ---------------------------------------------------------------- forward

    @eager_only
    def _pre_forward(self, module, args):
        FWD_MODULE_STACK.append(module)
        self.coordinator.fetch_sub_module(module, forward=True)

    @eager_only
    def _post_forward(self, module, args, output):
        pop_forward_module(module)
        raised = sys.exc_info()[0] is not None
        if not raised:
            self._register_returned_params(module, output)
        # Inside a backward (a checkpoint's recompute), whether this module's backward is still to come
        # ([Note: release at last use in a recompute]); an exception leaves that open, so it counts as coming.
        follows = raised or not in_autograd_engine() or carries_grad(output)
        self.coordinator.release_sub_module(module, forward=True, backward_follows=follows)

    def _register_returned_params(self, module, output):
        """A module that returns a ZeRO parameter hands it to its caller: register it there as external."""
        for item in _tensors_of(output):
            if not (is_zero_param(item) or hasattr(item, "ds_param_alias")):
                continue
            param = item if hasattr(item, "ds_id") else item.ds_param_alias
            if any(id(param) in getattr(m, "_external_params", {}) for m in FWD_MODULE_STACK):
                continue
            param.is_external_param = True
            if FWD_MODULE_STACK:
                register_external_parameter(FWD_MODULE_STACK[-1], param)
            # Covered by the caller from now on, not by the module that returned it.
            if id(param) in getattr(module, "_external_params", {}):
                unregister_external_parameter(module, param)
            self.coordinator.gather_read(param)

    # ---------------------------------------------------------------- backward

    @eager_only
    def _wrap_inputs(self, module, args):
        if not torch.is_grad_enabled():
            return None
        self._begin_grad_count(module)

        def wrap(tensor):
            if not tensor.requires_grad:
                return tensor
            module.ds_grads_remaining += 1
            return BackwardHook.apply(self.input_grad_done, module, tensor)

        return apply_to_tensors_only(wrap, args, warning_msg_fn=_unexpected_type_warning)

    def _begin_grad_count(self, module: Module) -> None:
        """Start counting ``module``'s gradient-carrying inputs, once per pass (a module may run twice in one)."""
        stamp = self.coordinator.stats.passes_started
        if module.__dict__.get("_zero3_grad_stamp") != stamp:
            module._zero3_grad_stamp = stamp
            module.ds_grads_remaining = 0

    @eager_only
    def _wrap_outputs(self, module, args, output):
        if not torch.is_grad_enabled():
            return None

        def wrap(tensor):
            if not tensor.requires_grad:
                return tensor
            return BackwardHook.apply(self.pre_backward, module, tensor)

        return apply_to_tensors_only(wrap, output, warning_msg_fn=_unexpected_type_warning)

    @eager_only
    def after_state_load(self, module, incompatible_keys):
        """``load_state_dict`` on a root ended: what it wrote into kept parameters becomes their partition."""
        self.coordinator.after_state_load()

    @eager_only
    def pre_backward(self, module):
        self.coordinator.fetch_sub_module(module, forward=False)

    @eager_only
    def input_grad_done(self, module):
        # Autograd may run this on its own threads (GPU, a z3 leaf with several outputs).
        with self.coordinator.lock:
            module.ds_grads_remaining -= 1
            last = module.ds_grads_remaining == 0
        if last:
            self.coordinator.release_sub_module(module, forward=False)


def pop_forward_module(module: Module) -> None:
    """``module``'s forward ended: take it off ``FWD_MODULE_STACK`` if it is on top."""
    if FWD_MODULE_STACK and FWD_MODULE_STACK[-1] is module:
        FWD_MODULE_STACK.pop()


def _tensors_of(output):
    if output is None:
        return []
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return list(output)
    mapping = output if isinstance(output, dict) else getattr(output, "__dict__", {})
    return [v for k, v in mapping.items() if not str(k).startswith("__") and torch.is_tensor(v)]
