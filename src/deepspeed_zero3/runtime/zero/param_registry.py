"""State that belongs to a model's sharded parameters, shared by every engine over that model.

[Note: sharing one module tree]
Lightning's ``trainer.validate(model)`` then ``trainer.fit(model)`` builds two engines over one
module, each around a new wrapper. Upstream gives each its own hooks, coordinator and in-flight
registry over the same parameters and numbers the modules again, so the first engine's state
disagrees with the parameters (``status: INFLIGHT``, ``pop from an empty deque``).
* Rule: hooks, coordinator and numbering live in one ``ParamStateRegistry``, reachable from every
  module of the tree. A new engine joins it: managed modules keep their ``ds_id`` and hooks, new
  ones (the wrapper) get fresh ids and hooks, a new root gets pass-boundary hooks.
* Owners are held weakly; ``destroy()`` or collection drops one, and the last removes every hook.
* The prefetch settings of the most recently joined live owner apply. Settings fixed when the
  parameters were converted (group, dtype, persistence thresholds) must match, or ``initialize``
  fails naming both values.
"""

import weakref
from typing import TYPE_CHECKING, Dict, List, Tuple

from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from deepspeed.utils import z3_leaf_module
from deepspeed.utils.logging import logger

from deepspeed_zero3.runtime.zero.hooks import HookRouter, ModuleHooks, handle_is_live
from deepspeed_zero3.runtime.zero.registry_lookup import REGISTRY_ATTR, find_registry  # noqa: F401 (importers' name)
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings

if TYPE_CHECKING:
    from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator


class ParamStateRegistry:
    """Hooks, coordinator and owners of one managed module tree."""

    def __init__(self, coordinator: "PartitionedParameterCoordinator", fixed_settings: Dict[str, object]):
        self.coordinator = coordinator
        self.router = HookRouter(coordinator)
        self.fixed_settings = dict(fixed_settings)
        self.alive = True
        self.next_ds_id = 0
        # Weak keys: a wrapper module dropped with its engine (Lightning's pattern) must not be kept alive here.
        self.module_hooks: Dict[Module, ModuleHooks] = weakref.WeakKeyDictionary()
        self.root_hooks: Dict[Module, Tuple[RemovableHandle, ...]] = weakref.WeakKeyDictionary()
        # Per root, a load_state_dict post-hook ([Note: keeping across no-grad passes]): not a forward hook, so not
        # in upstream's hook lists that clients empty and count.
        self.load_hooks: Dict[Module, RemovableHandle] = weakref.WeakKeyDictionary()
        # (weak owner, its prefetch settings), in joining order.
        self.owners: List = []
        coordinator.prediction.managed_modules = self.managed_modules  # [Note: first-pass prediction]

    # ---------------------------------------------------------------- the module tree

    def adopt_tree(self, root: Module) -> None:
        """Number and hook every module under ``root`` not yet managed; (re)hook ``root`` as a pass root.

        Numbering is a pre-order walk that stops at z3 leaf modules, as upstream numbers, so a single
        engine's ds_ids equal upstream's. Idempotent: hooks removed by someone else are put back.
        """
        stack = [root]
        while stack:
            module = stack.pop()
            if module.__dict__.get(REGISTRY_ATTR) is not self:
                module.ds_id = self.next_ds_id
                self.next_ds_id += 1
                module.__dict__[REGISTRY_ATTR] = self
            hooks = self.module_hooks.get(module)
            if hooks is None or not hooks.live():
                for handle in hooks.all() if hooks is not None else ():
                    handle.remove()
                self.module_hooks[module] = self.router.install_module_hooks(module)
            if z3_leaf_module(module):
                for param in module.parameters():
                    param.ds_z3_leaf_module = module
            else:
                stack.extend(reversed(list(module.children())))
        handles = self.root_hooks.get(root, ())
        if not handles or not all(handle_is_live(h) for h in handles):
            for handle in handles:
                handle.remove()
            self.root_hooks[root] = self.router.install_root_hooks(root)
        load_hook = self.load_hooks.get(root)
        if load_hook is None or not handle_is_live(load_hook):
            self.load_hooks[root] = root.register_load_state_dict_post_hook(self.router.after_state_load)

    def managed_modules(self) -> List[Module]:
        return list(self.module_hooks)

    def hook_count(self) -> int:
        """Live hooks installed by this registry (tests count them)."""
        return sum(handle_is_live(h) for h in self.handles())

    def handles(self) -> List[RemovableHandle]:
        module_handles = [h for hooks in list(self.module_hooks.values()) for h in hooks.all()]
        return module_handles + [h for handles in list(self.root_hooks.values()) for h in handles]

    def remove_all_hooks(self) -> None:
        for handle in self.handles():
            handle.remove()
        self.module_hooks.clear()
        self.root_hooks.clear()

    # ---------------------------------------------------------------- owners

    def check_fixed_settings(self, fixed_settings: Dict[str, object]) -> None:
        for key, value in fixed_settings.items():
            mine = self.fixed_settings.get(key)
            if mine != value:
                raise ValueError(f"deepspeed-zero3: this module is already managed by another engine with {key}={mine!r}; "
                                 f"the new engine asks for {key}={value!r}. {key} is fixed once parameters are "
                                 f"partitioned, so every engine over one module must use the same value "
                                 f"(or destroy() the other engine first).")

    def add_owner(self, owner, settings: PrefetchSettings) -> None:
        self.owners.append((weakref.ref(owner, self._owner_collected), settings))
        self.coordinator.apply_settings(settings)
        if len(self.owners) > 1:
            logger.info(f"deepspeed-zero3: engine joined the parameter registry of an already-managed module "
                        f"({len(self.owners)} owners)")

    def live_owners(self) -> List:
        return [ref() for ref, _ in self.owners if ref() is not None]

    def drop_owner(self, owner) -> None:
        self.owners = [(ref, s) for ref, s in self.owners if ref() is not None and ref() is not owner]
        self._after_owner_change()

    def _owner_collected(self, ref) -> None:
        self.owners = [(r, s) for r, s in self.owners if r is not ref and r() is not None]
        self._after_owner_change()

    def _after_owner_change(self) -> None:
        if not self.alive:
            return
        if self.owners:
            self.coordinator.apply_settings(self.owners[-1][1])
            return
        self.close()

    def close(self) -> None:
        """No owner left: release everything gathered, remove every hook, forget the tree."""
        self.alive = False
        try:
            self.coordinator.reset_step()
        finally:
            modules = list(self.module_hooks) + list(self.root_hooks)
            self.remove_all_hooks()
            for handle in list(self.load_hooks.values()):
                handle.remove()
            self.load_hooks.clear()
            for module in modules:
                if module.__dict__.get(REGISTRY_ATTR) is self:
                    del module.__dict__[REGISTRY_ATTR]
