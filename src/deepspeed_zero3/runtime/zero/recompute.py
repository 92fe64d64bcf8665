"""What an activation checkpoint's recompute changes about when a parameter may be released.

[Note: release at last use in a recompute]
A backward pass runs a checkpointed region's forward again (a recompute), so modules run
forward hooks inside the backward. Two rules follow, both about where a parameter's last
use in that backward is:
* A module recomputed whose outputs carry no gradient gets no backward of its own in this
  pass (a frozen embedding fed token ids, a LoRA base layer whose input needs no grad):
  its forward was the last use, so its post-forward releases as in a forward pass. One
  whose outputs carry a gradient keeps its parameters for its backward, as before.
* A module's backward claims an external parameter (one it reads but does not own) only
  if some forward since the last backward may have saved it for backward by reference.
  A read inside a checkpoint's forward cannot: under ``torch.utils.checkpoint``'s
  saved-tensor hooks autograd saves a handle, and a reentrant checkpoint's forward runs
  without grad. Its recompute gets the parameter from the owner's own fetch.
A parameter never seen read is claimed: the rules only drop a claim autograd cannot need.
Released this way, a parameter the same backward uses again is kept for that use or gathered
again by the reuse distance, as in any pass; values never change.
"""

from typing import Optional

import torch
from torch.nn import Module, Parameter

from deepspeed.runtime.zero.utils import apply_to_tensors_only

_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def in_autograd_engine() -> bool:
    """True while the autograd engine executes a graph (backward, and recomputation inside it)."""
    return torch._C._current_graph_task_id() != -1


def read_saves_no_reference() -> bool:
    """Whether a tensor read now cannot be saved for backward as itself: grad is off, or the innermost
    saved-tensor hooks are ``torch.utils.checkpoint``'s (which save a handle and recompute)."""
    if not torch.is_grad_enabled():
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", "") == _CHECKPOINT_MODULE


def carries_grad(output) -> bool:
    """Whether a module output holds a tensor that requires grad (what its backward hooks are put on)."""
    found = []

    def look(tensor):
        if tensor.requires_grad:
            found.append(True)
        return tensor

    apply_to_tensors_only(look, output)
    return bool(found)


def is_external_of(module: Module, param: Parameter) -> bool:
    """Whether ``param`` is registered as an external parameter of ``module`` (upstream keys them by id)."""
    return id(param) in module.__dict__.get("_external_params", ())


class ExternalReads:
    """For each (module, external parameter) read in the forwards since the last backward, whether any read
    may have saved the parameter by reference ([Note: release at last use in a recompute]). A pass's reads are
    buffered on the pass (``RunningPass.external_reads``, written by ``record``) and committed at its end unless it
    was silent or aborted ([Note: silent passes]): a forward that one rank alone runs changes nothing here."""

    def __init__(self):
        self.by_reference = {}
        self.backward_since = False

    def record(self, module: Module, param: Parameter, pending: Optional[dict]) -> None:
        """``module`` read ``param`` now: into ``pending`` (the running pass's reads), or, between passes, at once."""
        reads = pending if pending is not None else {}
        key = (module.ds_id, param.ds_id)
        reads[key] = reads.get(key, False) or not read_saves_no_reference()
        if pending is None:
            self.commit(reads, forward_with_grad=False)

    def commit(self, reads: dict, forward_with_grad: bool) -> None:
        """A pass that was neither silent nor aborted ended: its reads count from now on. The first forward with
        grad after a backward starts the record afresh."""
        if forward_with_grad and self.backward_since:
            self.by_reference.clear()
            self.backward_since = False
        for key, by_reference in reads.items():
            self.by_reference[key] = self.by_reference.get(key, False) or by_reference

    def backward_ended(self) -> None:
        self.backward_since = True

    def claims(self, module: Module, param: Parameter, pending: dict) -> bool:
        """Whether ``module``'s backward must hold ``param`` gathered until its post-backward; ``pending``: the
        running pass's reads, not committed yet."""
        key = (module.ds_id, param.ds_id)
        if key in pending:
            return pending[key] or self.by_reference.get(key, False)
        return self.by_reference.get(key, True)

    def mark_in_use(self, module: Module, params, backward_reads: Optional[dict]) -> None:
        """``module``'s fetch uses ``params`` until its release. ``backward_reads``: for a fetch of ``module``'s
        backward, the running pass's reads: there an external parameter is held only if claimed."""
        for param in params:
            if (backward_reads is None or not is_external_of(module, param)
                    or self.claims(module, param, backward_reads)):
                param.ds_active_sub_modules.add(module.ds_id)

    def clear(self) -> None:
        self.by_reference.clear()
        self.backward_since = False
