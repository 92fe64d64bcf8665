"""``stage3_module_granularity_threshold``: which modules become z3 leaves, and how leaves are fetched and released.

[Note: module granularity]
Upstream's meaning, computed the same way so that the same modules become leaves:
* A module's granularity is its subtree's numel (``ds_numel``; a parameter shared by two children
  counts in both) divided by its "layers": its childless modules with parameters, the non-container
  modules between them and it, and itself. A container passes its children's layers up.
* It is ``sys.maxsize`` (never a leaf) for a module without parameters, a childless module, a module
  whose class name is one of torch's containers (a container may never run ``forward``), and a
  subtree over ``Z3_MAX_LEAF_SIZE`` numel.
* Leaves are chosen top-down: the first module on a path at or under the threshold becomes a leaf
  and its subtree is not entered. The root may qualify (one fetch then gathers the model; upstream's
  results there are not bitwise reproducible, so ours are not compared).
* With no module qualifying, the warning names the smallest granularity and no leaf is set.
Leaves are set before the tree is numbered, as upstream does, so ``ds_id``s equal upstream's.

[Note: fast sharding for leaf modules]
With a threshold set (any value > 0, whether or not a leaf was chosen), upstream fetches and releases
every z3 leaf module, also ones set by the user, with ``fast_sharding_for_leaf_module``:

* waiting for a leaf's gather does not make the gathered partitions' memory wait for the compute stream
  (``handle_dependency=False``) and records no back-pressure event; the partitions are kept referenced
  until every parameter of the leaf is waited for, then dropped (``AllGatherCoalescedHandle.free_buffer``);
* releasing a leaf's parameter partitions it without freeing through ``free_param`` (no
  ``record_stream``), and its data becomes a one-element tensor on the device, one per release call,
  allocated after the leaf's compute was queued.

Values are unaffected: the same partitions are gathered and the released data is never read. On CPU
(a synchronized device) the waits are identical to ordinary ones; what is observable is the released
parameters' data, ``torch.empty(1)`` (default dtype) rather than an empty tensor of the parameter's dtype.
``FastLeafSharding`` does exactly that for the modules upstream does it for, at release points chosen
by our own policy (prefetch window, reuse distance), not by upstream's.
"""

import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch.nn import Module, Parameter

from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger, set_z3_leaf_module, z3_leaf_module

from deepspeed_zero3.runtime.zero.settings import validate_numel

# Upstream's bound on a leaf's subtree numel (a float there too: compared with ints).
Z3_MAX_LEAF_SIZE = 1e9
NOT_A_LEAF = sys.maxsize


def _is_container(module: Module) -> bool:
    # By class name, as upstream decides it: a user class called ``Sequential`` is a container too.
    return type(module).__name__ in torch.nn.modules.container.__all__


@dataclass
class LeafSelection:
    """What a threshold selects over one module tree ([Note: module granularity])."""

    threshold: int
    granularity: dict = field(default_factory=dict)  # module -> granularity value
    smallest_value: int = NOT_A_LEAF
    smallest_class: Optional[str] = None
    leaves: List[Module] = field(default_factory=list)

    def describe_leaves(self) -> str:
        return ", ".join(f"{type(m).__name__}:{self.granularity[m]}" for m in self.leaves)


def _measure(module: Module, selection: LeafSelection):
    """Post-order walk: ``(layers, numel)`` of ``module``'s subtree; records each module's granularity."""
    if next(module.parameters(), None) is None:
        selection.granularity[module] = NOT_A_LEAF
        return 0, 0
    numel = sum(p.ds_numel for p in module.parameters(recurse=False))
    children = list(module.children())
    if not children:
        selection.granularity[module] = NOT_A_LEAF
        return 1, numel
    layers = 0
    for child in children:
        child_layers, child_numel = _measure(child, selection)
        layers += child_layers
        numel += child_numel
    if _is_container(module):
        selection.granularity[module] = NOT_A_LEAF
        return layers, numel
    layers += 1
    value = numel // layers if numel <= Z3_MAX_LEAF_SIZE else NOT_A_LEAF
    selection.granularity[module] = value
    if value < selection.smallest_value:  # strict: the first module in post-order with the smallest value
        selection.smallest_value = value
        selection.smallest_class = type(module).__name__
    return layers, numel


def _choose(module: Module, selection: LeafSelection) -> None:
    """Pre-order: a qualifying module becomes a leaf and its subtree is not entered."""
    if next(module.parameters(), None) is None:
        return
    if selection.granularity[module] <= selection.threshold:
        selection.leaves.append(module)
        return
    for child in module.children():
        _choose(child, selection)


def select_leaves(root: Module, threshold: int) -> LeafSelection:
    """The modules ``threshold`` makes z3 leaves (nothing is changed). Parameters must be ZeRO parameters."""
    selection = LeafSelection(threshold=threshold)
    _measure(root, selection)
    if selection.smallest_value <= threshold:
        _choose(root, selection)
    return selection


def apply_granularity_threshold(root: Module, threshold: int) -> LeafSelection:
    """Set the z3 leaves ``threshold`` selects over ``root``; warn when it selects none."""
    selection = select_leaves(root, threshold)
    for module in selection.granularity:
        # Upstream leaves this attribute on every module it measured; tools read it.
        module.ds_model_granularity = selection.granularity[module]
    for module in selection.leaves:
        set_z3_leaf_module(module, True)
    if selection.leaves:
        logger.info(f"deepspeed-zero3: stage3_module_granularity_threshold={threshold} made "
                    f"{len(selection.leaves)} z3 leaf module(s): {selection.describe_leaves()}")
    elif selection.smallest_class is None:
        logger.warning(f"deepspeed-zero3: stage3_module_granularity_threshold={threshold} has no effect: no module "
                       f"of this model can become a z3 leaf (each is a container, has no children, has no "
                       f"parameters, or holds more than {int(Z3_MAX_LEAF_SIZE)} parameters)")
    else:
        logger.warning(f"deepspeed-zero3: stage3_module_granularity_threshold={threshold} has no effect: the "
                       f"smallest module granularity in this model is {selection.smallest_value} "
                       f"({selection.smallest_class}); set stage3_module_granularity_threshold >= "
                       f"{selection.smallest_value} for it to make z3 leaf modules")
    return selection


def check_granularity_threshold(value) -> int:
    """The threshold as a numel (0: off), validated like every other ``stage3_*`` numel (settings.py)."""
    return validate_numel("stage3_module_granularity_threshold", value)


class FastLeafSharding:
    """Upstream's ``fast_sharding_for_leaf_module`` releases ([Note: fast sharding for leaf modules]); its waits are
    ``Gatherer.wait(params, fast_leaf=True)``."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)

    def applies_to(self, module: Module) -> bool:
        return self.enabled and z3_leaf_module(module)

    @staticmethod
    def releaser():
        """A partition function for one release call: every parameter it releases shares one placeholder."""
        placeholder = []

        def partition(param: Parameter) -> None:
            if not placeholder:
                placeholder.append(torch.empty(1, device=torch.device(get_accelerator().current_device_name())))
            param.partition(free_data=False)
            param.data = placeholder[0]

        return partition

