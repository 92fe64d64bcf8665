"""ZenFlow's parameter layout on the ZeRO-3 fetch path (``zero_optimization.zenflow`` with stage 3).

[Note: ZenFlow layout]
ZenFlow's stage-3 optimizer transposes every parameter that is not 1-D before ZeRO partitions it,
so partitions and ``ds_shape`` are in that storage layout while modules compute in the original
one. Upstream's hooks transpose each fetched 2-D parameter after a module's fetch (forward and
backward, persistent, external and z3-leaf-subtree parameters included) and back before its
release, once per hook call, so overlapping calls flip a parameter twice (a module whose several
outputs each fire its pre-backward hook; a checkpointed module recomputed in its own backward).
Rule here: a parameter is in compute layout exactly while a module that fetched it has not
released it (``ds_active_sub_modules`` not empty): flipped at the first fetch, back at the last
release, and back at every pass end for what a missing hook left flipped. Where upstream's calls
do not overlap, that is the same sequence of transpositions. Parameters with more than two
dimensions have no defined layout (upstream's ``.t()`` fails) and are refused when the engine
is built.
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
