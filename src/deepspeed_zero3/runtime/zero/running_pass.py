"""The state of the one pass that runs now.

[Note: the running pass]
At most one pass runs at a time: a forward from the root's pre-forward hook to its
forward hook, a backward from its first backward hook to the completion of its
autograd graph task ([Note: one prefetcher per pass], [Note: the end of a backward]). Everything that belongs to
that pass alone lives on one ``RunningPass``, held as ``coordinator.running``:
its kind, where it stands against its trace, its prefetcher, the parameter list
each module's fetch took, the modules whose backward has begun and not ended,
its counters, its NVMe reads ahead and the external reads it saw (committed only at
a non-silent, non-aborted end, [Note: silent passes]). The coordinator creates it in ``_begin_pass`` and drops it in
``_end_pass``, nowhere else, so a pass's state cannot leak into the next one and
no field needs clearing by hand. ``running is None`` is the idle state. The
coordinator's entry points read ``running`` once; a helper that needs the pass takes
it as an argument, and one that runs between passes says so.
State that outlives a pass is the coordinator's: what is gathered (its
``Residency``), the traces, the link from a forward to its backward
(``BackwardKeeping``), what an eval forward carried for the next forward
(``NoGradKeeping``) and the committed external reads (``ExternalReads``).
"""

from typing import Dict, Optional, Sequence, Tuple

from torch.nn import Module, Parameter

from deepspeed_zero3.runtime.zero.module_params import fetch_params
from deepspeed_zero3.runtime.zero.nvme_swap import NvmeSwapIns
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
from deepspeed_zero3.runtime.zero.stats import PassStats
from deepspeed_zero3.runtime.zero.trace import PassProgress, PassTrace


class RunningPass:
    """One pass from its start to its end ([Note: the running pass])."""

    def __init__(self, kind: PassKind, progress: PassProgress, prefetcher: Optional[PassPrefetcher],
                 stats: PassStats, swap_ins: Optional[NvmeSwapIns] = None):
        self.kind = kind
        self.progress = progress
        self.prefetcher = prefetcher  # None: prefetching is off, or the pass left its trace
        self.stats = stats
        # NVMe offload only: the partitions this pass read ahead ([Note: NVMe swap-in ahead]).
        self.swap_ins = swap_ins
        # Module ds_id -> the parameter list its fetch in this pass read from the trace: its release covers
        # exactly that list ([Note: cached parameter lists]).
        self.fetched_from: Dict[int, Tuple[Parameter, ...]] = {}
        # Backward passes: modules fetched whose post-backward hook has not fired yet.
        self.active_backward: Dict[int, Module] = {}
        # (module ds_id, parameter ds_id) -> whether a read may have saved it by reference ([Note: release at last
        # use in a recompute]): this pass's reads, committed to the coordinator's ExternalReads at its end.
        self.external_reads: Dict[Tuple[int, int], bool] = {}
        # Modules given parameters through upstream's update_recompute_parameters in this pass.
        self.recompute_owners: Dict[int, Module] = {}
        # All-gathers this pass issued and parameters it released: with neither, the pass changed nothing ([Note:
        # silent passes]). Its own counts, not the stats', which a user may reset in the middle of a pass.
        self.gathered = 0
        self.released = 0
        # Whether the ranks were asked to agree on this pass yet ([Note: ranks in different passes]).
        self.agreed = False
        # Why a parameter released in this pass stays gathered ([Note: a keep rule per pass]); the coordinator
        # sets it as the pass begins and whenever its replayed trace switches or is left.
        self.keep_rule = None

    @property
    def is_backward(self) -> bool:
        return self.kind is PassKind.BACKWARD

    @property
    def step(self) -> int:
        """The step of the trace the pass is at (-1 before its first module)."""
        return self.progress.trace_step

    def params_to_fetch(self, module: Module, step: int) -> Sequence[Parameter]:
        """``fetch_params(module)``, from the replayed trace when it holds them ([Note: cached parameter lists])."""
        trace = self.progress.trace
        params = trace.params_at(step, module) if trace is not None else None
        if params is not None:
            self.fetched_from[module.ds_id] = params
            return params
        self.fetched_from.pop(module.ds_id, None)
        return fetch_params(module)

    def params_to_release(self, module: Module) -> Sequence[Parameter]:
        """What ``module``'s fetch in this pass covered: the list it took from the trace, else
        ``fetch_params(module, strict=False)``. External parameters can be registered during the module's own
        forward (the getter), so a module with any is asked afresh: its release covers them, as upstream's does."""
        params = self.fetched_from.get(module.ds_id)
        if params is not None and not module.__dict__.get("_external_params"):
            return params  # initialize gives every module an empty _external_params: only a non-empty one counts
        return fetch_params(module, strict=False)

    def replayed_trace(self) -> Optional[PassTrace]:
        """The trace the pass follows, or None while it records (fetching on demand)."""
        return self.progress.trace if self.progress.replaying() else None
