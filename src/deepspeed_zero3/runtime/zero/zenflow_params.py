"""ZenFlow's parameter layout on the ZeRO-3 fetch path (``zero_optimization.zenflow`` with stage 3).

[Note: ZenFlow layout]
ZenFlow's stage-3 optimizer transposes every parameter that is not 1-D before ZeRO partitions it
(``p.data = p.data.t().contiguous()``), so partitions, ``ds_shape`` and the optimizer's column selection
are in that *storage* layout. Modules compute in the original layout. Upstream's parameter side therefore
transposes (``.t()``, a view) each fetched parameter whose ``ds_shape`` is not 1-D right after a module's
fetch, in forward and in backward, persistent and external parameters included, a z3 leaf's whole
subtree included, and transposes it back right before the module's release.

Upstream toggles once per hook call. Where hook calls overlap, that flips a parameter twice: a module
whose several outputs each fire its pre-backward hook, or a checkpointed module recomputed inside its own
backward. Here a parameter is in compute layout exactly while a module that fetched it has not released
it yet (``ds_active_sub_modules`` is not empty): flipped at the first fetch, back when the last holder
releases it, and back at the end of every pass for what a missing hook left flipped. Where upstream's
hook calls do not overlap (every module that runs once per pass, with one output), that is the same
sequence of transpositions as upstream's.

Only 1-D and 2-D layouts are defined (upstream's ``.t()`` fails on more dimensions, already in ZenFlow's
optimizer), so a parameter with more dimensions is refused when the engine is built.
"""

from typing import Dict, Iterable

from torch.nn import Module, Parameter

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.module_params import fetch_params


def _transposed(param: Parameter) -> bool:
    return len(param.ds_shape) != 1


def check_zenflow_params(named_params: Iterable) -> None:
    bad = [(name, tuple(p.ds_shape)) for name, p in named_params if len(p.ds_shape) > 2]
    if bad:
        listed = ", ".join(f"{name} {shape}" for name, shape in bad[:5])
        raise ValueError(f"deepspeed-zero3: ZenFlow (zero_optimization.zenflow) stores parameters transposed and "
                         f"supports only 1-D and 2-D parameters; {len(bad)} have more dimensions: {listed}")


class ZenFlowParamLayout:
    """Transposes a module's parameters into compute layout while it holds them ([Note: ZenFlow layout])."""

    def __init__(self):
        # Parameters currently in compute layout (an ordered set).
        self.flipped: Dict[Parameter, None] = {}

    def after_fetch(self, module: Module) -> None:
        for param in fetch_params(module, strict=False):
            if _transposed(param) and param not in self.flipped:
                param.data = param.data.t()
                self.flipped[param] = None

    def after_release(self, module: Module) -> None:
        for param in fetch_params(module, strict=False):
            if param in self.flipped and not param.ds_active_sub_modules:
                self._restore(param)

    def restore_all(self) -> None:
        """End of a pass: every parameter back in storage layout."""
        for param in list(self.flipped):
            self._restore(param)

    def _restore(self, param: Parameter) -> None:
        del self.flipped[param]
        # A parameter released meanwhile holds no data (its next gather brings storage layout).
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            param.data = param.data.t()
