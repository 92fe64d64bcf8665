"""Finding the registry, and its coordinator, that manages a module: a leaf every other runtime file may import.

The registry's own file imports the hooks, and the hooks name the coordinator, so looking a registry up from the
getter, the stats read-out or upstream's helper names through ``param_registry`` would close an import circle
(``tests/unit/test_import_graph.py`` fails on any). This module imports nothing of the runtime.
"""

from typing import Optional

from torch.nn import Module

# Where a managed module keeps its registry ([Note: sharing one module tree], param_registry.py).
REGISTRY_ATTR = "_zero3_registry"


def find_registry(module: Module):
    """The live ``ParamStateRegistry`` managing ``module`` or any module inside it, if there is one."""
    for candidate in module.modules():
        registry = candidate.__dict__.get(REGISTRY_ATTR)
        if registry is not None and registry.alive:
            return registry
    return None


def module_coordinator(module: Module):
    """The coordinator of the registry managing ``module`` (or a module inside it), None if none does."""
    registry = find_registry(module)
    return registry.coordinator if registry is not None else None


def coordinator_of(target, api: str = "get_zero3_stats"):
    """The coordinator behind an engine, a ZeRO-3 optimizer, a DeepSpeedZeRoOffload, or a managed module.

    ``api`` names the public function asking, for the error message.
    """
    optimizer = getattr(target, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None) or optimizer
    coordinator: Optional[object] = getattr(offload, "param_coordinator", None)
    if coordinator is None:
        coordinator = getattr(getattr(target, "parameter_offload", None), "param_coordinator", None)
    if coordinator is None:
        coordinator = getattr(target, "param_coordinator", None)
    if coordinator is None and hasattr(target, "modules"):
        coordinator = module_coordinator(target)
    if coordinator is None or not hasattr(coordinator, "stats"):
        raise ValueError(f"{api} expects a DeepSpeed engine running ZeRO stage 3 with the deepspeed-zero3 "
                         f"runtime (or its module); got {type(target).__name__}. Is the overlay active? "
                         f"Run `python -m deepspeed_zero3`.")
    return coordinator
