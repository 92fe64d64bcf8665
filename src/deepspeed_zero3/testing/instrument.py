"""An outside instrument that measures upstream's runtime and ours the same way.

It is how the upstream figures in docs/benchmarks.md were measured:

* all-gather traffic: ``deepspeed.comm.allgather_fn`` and
  ``deepspeed.comm.all_gather_into_tensor`` are wrapped, and the output numel
  of each call is added to the current phase;
* demand fetches: before each ``fetch_sub_module``, the ``ds_numel`` of the
  submodule's own parameters that are ``NOT_AVAILABLE``;
* live gathered numel: after each fetch, the ``ds_numel`` of every
  non-persistent parameter whose ``ds_status`` is not ``NOT_AVAILABLE``.

[Note: the meter's parameter list]
Which parameters to look at is read from the model at installation and again
at every ``phase()`` and ``reset()``, not at every fetch: walking the parameters
of a 2,000-module model after each fetch cost more than the steps it measured,
in both runtimes alike. A module attached in the middle of a phase is counted
from the next one.

The phase (forward, backward, step, eval_forward, ...) is set by the driver.
Wrapping ``fetch_sub_module`` of whichever coordinator class is loaded works for
both runtimes, since both keep that public method.
"""

import contextlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Dict, List

import deepspeed.comm as ds_comm
from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


@dataclass
class PhaseCounts:
    allgather_calls: int = 0
    allgather_numel: int = 0
    demand_numel: int = 0
    peak_live_numel: int = 0
    fetches: int = 0
    # live numel after each fetch, in order (for timeline plots)
    timeline: List[int] = field(default_factory=list)


class GatherMeter:
    """Counts all-gathers, demand fetches and live gathered numel of one model, per phase."""

    def __init__(self, model, keep_timeline: bool = False):
        self.model = model
        self.keep_timeline = keep_timeline
        self.phase_name = "other"
        self.phases: Dict[str, PhaseCounts] = defaultdict(PhaseCounts)
        self._saved = []
        self._tracked = []

    # ------------------------------------------------------------ installation

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.uninstall()

    def install(self):
        self._track()
        for name in ("allgather_fn", "all_gather_into_tensor"):
            original = getattr(ds_comm, name)
            self._saved.append((ds_comm, name, original))
            setattr(ds_comm, name, self._wrap_collective(original))
        cls = coordinator_module.PartitionedParameterCoordinator
        original_fetch = cls.fetch_sub_module
        self._saved.append((cls, "fetch_sub_module", original_fetch))
        meter = self

        def fetch_sub_module(coordinator, current_submodule, *args, **kwargs):
            meter.phases[meter.phase_name].demand_numel += sum(
                p.ds_numel for p in current_submodule.parameters(recurse=False)
                if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
            result = original_fetch(coordinator, current_submodule, *args, **kwargs)
            meter._after_fetch()
            return result

        cls.fetch_sub_module = fetch_sub_module

    def uninstall(self):
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _wrap_collective(self, original):
        meter = self

        def counted(output_tensor, *args, **kwargs):
            counts = meter.phases[meter.phase_name]
            counts.allgather_calls += 1
            counts.allgather_numel += output_tensor.numel()
            return original(output_tensor, *args, **kwargs)

        return counted

    def _after_fetch(self):
        live = self.live_numel()
        counts = self.phases[self.phase_name]
        counts.fetches += 1
        counts.peak_live_numel = max(counts.peak_live_numel, live)
        if self.keep_timeline:
            counts.timeline.append(live)

    # ------------------------------------------------------------ reading

    def _track(self):
        """[Note: the meter's parameter list]"""
        self._tracked = [p for p in self.model.parameters() if not getattr(p, "ds_persist", False)]

    def live_numel(self) -> int:
        not_available = ZeroParamStatus.NOT_AVAILABLE
        return sum(p.ds_numel for p in self._tracked if p.ds_status != not_available)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._track()
        previous, self.phase_name = self.phase_name, name
        try:
            yield self.phases[name]
        finally:
            self.phase_name = previous

    def reset(self):
        self._track()
        self.phases.clear()

    def snapshot(self) -> Dict[str, dict]:
        return {name: asdict(counts) for name, counts in self.phases.items()}
