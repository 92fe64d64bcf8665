"""Recorded module order of one pass, and a small cache of them.

[Note: trace selection]
A pass is identified by what runs, never by ``nn.Module.training``. Its kind (forward
with grad, forward without, backward) picks a cache bucket, and the bucket's most
recently used trace is replayed. At each module the observed order is checked against
it; at the first difference the pass switches to the most recent cached trace whose
prefix equals everything observed, else it records from there (fetching on demand),
and its order becomes a new entry when it ends normally. A guess ([Note: first-pass
prediction]) is followed loosely: a module that gathers nothing may run anywhere in it.
Invariant: every input to the choice (kind, observed order, cache contents and recency)
is equal on every rank while the ranks run the same modules, so they issue the same
collectives; ranks that do not are caught by [Note: diverging ranks].
"""

import bisect
import enum
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from torch.nn import Module, Parameter

from deepspeed_zero3.runtime.zero.module_params import fetch_params, gathers_anything, params_signature
from deepspeed_zero3.runtime.zero.passes import PassKind


class PassTrace:
    """The module order of one completed pass and the parameter uses derived from it.

    The order and the uses never change once built; the coordinator links a forward trace to the backward
    that followed it (``next_backward``, ``forwards_per_backward``)."""

    # A guess made before the pass ran (prediction.py), not an observed order: never cached.
    predicted = False

    def __init__(self, kind: PassKind, modules: Sequence[Module]):
        self.kind = kind
        # Weak: a trace must not keep a dropped wrapper module (and through its hooks, its engine) alive.
        # A trace whose module is gone never matches again and ages out of the cache.
        self.module_refs: Tuple[weakref.ref, ...] = tuple(weakref.ref(m) for m in modules)
        self.module_ids: Tuple[int, ...] = tuple(m.ds_id for m in modules)
        # Parameters are read when the pass has ended, so external parameters discovered
        # during the pass are included, as they will be when it is replayed.
        self.step_params: Tuple[Tuple[Parameter, ...], ...] = tuple(tuple(fetch_params(m)) for m in modules)
        # [Note: cached parameter lists]: taken together with step_params, which holds what they identify.
        self.step_signatures: Tuple[Optional[tuple], ...] = tuple(params_signature(m) for m in modules)
        self.param_uses: Tuple[Tuple[Parameter, int], ...] = tuple(
            (param, step) for step, params in enumerate(self.step_params) for param in params)
        step_numel = [sum(p.ds_numel for p in params) for params in self.step_params]
        self.cumulative_numel: List[int] = [0]
        for numel in step_numel:
            self.cumulative_numel.append(self.cumulative_numel[-1] + numel)
        self.use_steps: Dict[Parameter, List[int]] = {}
        for param, step in self.param_uses:
            steps = self.use_steps.setdefault(param, [])
            if not steps or steps[-1] != step:
                steps.append(step)
        # Set by the coordinator: the backward trace that last followed this forward trace, and how many
        # forwards with grad that backward's step ran ([Note: budgeted keeping]).
        self.next_backward: Optional["PassTrace"] = None
        self.forwards_per_backward = 1

    def __len__(self):
        return len(self.module_refs)

    def module_at(self, step: int) -> Optional[Module]:
        return self.module_refs[step]() if 0 <= step < len(self.module_refs) else None

    def live_modules(self) -> List[Module]:
        """The trace's modules that still exist, in order."""
        return [m for m in (ref() for ref in self.module_refs) if m is not None]

    def params_at(self, step: int, module: Module) -> Optional[Tuple[Parameter, ...]]:
        """``fetch_params(module)``, read from the trace: None unless ``module`` runs ``step`` here and its
        parameters are still those recorded ([Note: cached parameter lists])."""
        if 0 <= step < len(self.module_refs) and self.module_refs[step]() is module:
            signature = self.step_signatures[step]
            if signature is not None and signature == params_signature(module):
                return self.step_params[step]
        return None

    def runs(self, observed: Sequence[Module]) -> bool:
        """Whether this trace starts with exactly these module objects."""
        return len(observed) <= len(self) and all(self.module_refs[i]() is m for i, m in enumerate(observed))

    @property
    def total_numel(self) -> int:
        return self.cumulative_numel[-1]

    def starts_with(self, observed_ids: Sequence[int]) -> bool:
        return len(observed_ids) <= len(self.module_ids) and tuple(
            self.module_ids[:len(observed_ids)]) == tuple(observed_ids)

    def next_use(self, param: Parameter, after_step: int) -> Optional[int]:
        """First step > ``after_step`` that uses ``param``, or None."""
        steps = self.use_steps.get(param)
        if not steps:
            return None
        index = bisect.bisect_right(steps, after_step)
        return steps[index] if index < len(steps) else None

    def last_use(self, param: Parameter) -> Optional[int]:
        steps = self.use_steps.get(param)
        return steps[-1] if steps else None

    def numel_between(self, start_step: int, stop_step: int) -> int:
        """Numel fetched by steps start_step .. stop_step-1 (the reuse distance between two uses)."""
        start_step = max(0, min(start_step, len(self)))
        stop_step = max(start_step, min(stop_step, len(self)))
        return self.cumulative_numel[stop_step] - self.cumulative_numel[start_step]

    def describe(self) -> str:
        return f"{self.kind.value} trace of {len(self)} modules, {self.total_numel} numel"


class TraceCache:
    """A few traces per pass kind, most recently used first. Bounded, so it cannot grow with step count."""

    def __init__(self, capacity_per_kind: int = 8):
        if capacity_per_kind < 1:
            raise ValueError(f"trace cache capacity must be >= 1, got {capacity_per_kind}")
        self.capacity_per_kind = capacity_per_kind
        self.traces: Dict[PassKind, List[PassTrace]] = {kind: [] for kind in PassKind}

    def most_recent(self, kind: PassKind) -> Optional[PassTrace]:
        bucket = self.traces[kind]
        return bucket[0] if bucket else None

    def find(self, kind: PassKind, observed_ids: Sequence[int], exact: bool = False) -> Optional[PassTrace]:
        for trace in self.traces[kind]:
            if exact and trace.module_ids == tuple(observed_ids):
                return trace
            if not exact and trace.starts_with(observed_ids):
                return trace
        return None

    def touch(self, trace: PassTrace) -> None:
        bucket = self.traces[trace.kind]
        if trace in bucket:
            bucket.remove(trace)
        bucket.insert(0, trace)
        del bucket[self.capacity_per_kind:]

    def add(self, trace: PassTrace) -> None:
        self.touch(trace)

    def clear(self) -> None:
        for bucket in self.traces.values():
            bucket.clear()

    def __len__(self):
        return sum(len(bucket) for bucket in self.traces.values())

    def finish(self, progress: "PassProgress") -> Tuple[Optional[PassTrace], bool]:
        """The trace a pass that ran to its end ran (None if it observed no module), moved to the front, and whether
        it was recorded now because no cached trace runs what it observed."""
        if not progress.observed:
            return None, False
        trace = progress.completed_trace()
        if trace is None:
            trace = self.find(progress.kind, progress.observed_ids, exact=True)
            if trace is not None and not trace.runs(progress.observed):
                trace = None
        recorded = trace is None
        if recorded:
            trace = PassTrace(progress.kind, progress.observed)
        self.touch(trace)
        return trace, recorded


class ReplayState(enum.Enum):
    REPLAYING = "replaying"  # following a cached trace: prefetch and reuse decisions use it
    RECORDING = "recording"  # no cached trace fits what runs: fetch on demand, record the order


class StepOutcome(enum.Enum):
    MATCHED = "matched"
    SWITCHED = "switched"  # moved to another cached trace
    DIVERGED = "diverged"  # left the trace, nothing in the cache fits: recording from here on
    RECORDING = "recording"


class PassProgress:
    """Where one running pass stands against its trace."""

    def __init__(self, kind: PassKind, cache: TraceCache, first_guess: Optional[PassTrace]):
        self.kind = kind
        self.cache = cache
        self.trace = first_guess
        self.state = ReplayState.REPLAYING if first_guess is not None else ReplayState.RECORDING
        self.observed: List[Module] = []
        self.observed_ids: List[int] = []
        # Step of ``trace`` the pass is at: the observed index, except on a guess ([Note: trace selection]).
        self.trace_step = -1

    @property
    def step(self) -> int:
        """Index of the module most recently observed (-1 before the first)."""
        return len(self.observed) - 1

    def observe(self, module: Module) -> StepOutcome:
        self.observed.append(module)
        self.observed_ids.append(module.ds_id)
        if self.state is ReplayState.RECORDING:
            self.trace_step = self.step
            return StepOutcome.RECORDING
        if self.trace.predicted:
            if self.trace.module_at(self.trace_step + 1) is module:
                self.trace_step += 1
                return StepOutcome.MATCHED
            if not gathers_anything(module):
                return StepOutcome.MATCHED  # nothing to gather or release for it: the guess still holds
        elif self.trace.module_at(self.step) is module:
            self.trace_step = self.step
            return StepOutcome.MATCHED
        self.trace_step = self.step
        replacement = self.cache.find(self.kind, self.observed_ids)
        if replacement is not None and replacement.runs(self.observed):
            self.trace = replacement
            return StepOutcome.SWITCHED
        self.trace = None
        self.state = ReplayState.RECORDING
        return StepOutcome.DIVERGED

    def replaying(self) -> bool:
        return self.state is ReplayState.REPLAYING

    def completed_trace(self) -> Optional[PassTrace]:
        """The trace this pass followed exactly, if it ran exactly a cached trace (never a guess)."""
        if (self.state is ReplayState.REPLAYING and not self.trace.predicted and self.trace.kind is self.kind
                and len(self.observed) == len(self.trace)):
            return self.trace
        return None
