"""A prefetcher walks one pass's trace ahead of execution.

[Note: one prefetcher per pass]
Upstream keeps one trace for forward+backward and one prefetch queue over it,
so the forward prefetcher walks on into the backward part of the trace, and
parameters it walks past are held gathered until their backward use. In steady
state that fills gathered memory up to ``stage3_max_live_parameters``
(by default, the whole model). Here a prefetcher is bound to the trace of the
pass it was created for and dies with that pass: the forward prefetcher stops
at the end of the forward trace, and the backward prefetcher is created when
backward starts and primed at once, so the first backward module finds its
parameters in flight.

[Note: the prefetch window]
``outstanding`` holds the parameters this prefetcher gathered for a step that
execution has not reached yet. Its numel is the window, and the window never
grows past ``stage3_prefetch_bucket_size`` (plus the rest of the one module that crosses
the line: the walk finishes the module it started, so that a module's small
bias is not left behind for a demand fetch). ``stage3_max_live_parameters`` caps it
further against everything gathered. Upstream instead adds a full bucket at
every module on top of what is already prefetched, which is how it climbs to
the live-parameter cap.

[Note: claims]
When the walk passes a use of a parameter that is already gathered (in use
now, or kept by the reuse distance), it does not gather it again; it records a
claim on that later step instead, and the release after the current use keeps
the parameter for the claimed step. Without the claim that later use would be
a demand fetch, because the cursor is already past it.
"""

from typing import Callable, Dict, List, Optional

from torch.nn import Parameter

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.trace import PassTrace


class PassPrefetcher:
    """Prefetch planning over one pass's trace. Pure bookkeeping: the coordinator issues the gathers.

    [Note: constant-cost planning]
    Every call made per fetch (``reached``, ``plan``, ``holds``, ``adopt``, ``forget``) costs the same
    whether the window holds 2 parameters or 500: the window's numel is a running counter, and what is
    outstanding is also indexed by its target step, so ``reached`` visits only the steps execution moved
    past (one per fetch) and the parameters due there. ``_swept_below`` is the smallest step that may
    still have entries; an entry added below it (never, in the coordinator's call order, but allowed)
    lowers it, so ``reached(step)`` still drops every entry whose target is ``<= step``.
    """

    def __init__(self, role: str, trace: PassTrace, bucket_numel: int):
        self.role = role  # "forward" or "backward": a label for logs and tests
        self.trace = trace
        self.bucket_numel = bucket_numel
        self.cursor = 0  # index into trace.param_uses of the first use not yet walked
        self.outstanding: Dict[Parameter, int] = {}  # gathered by us -> the step it was gathered for
        self.claims: Dict[Parameter, int] = {}  # param -> latest future step the walk assigned to it
        # [Note: constant-cost planning]: the same entries as ``outstanding``, by target step, and their numel.
        self.outstanding_by_step: Dict[int, Dict[Parameter, None]] = {}
        self._outstanding_numel = 0
        self._swept_below = 0

    @property
    def outstanding_numel(self) -> int:
        return self._outstanding_numel

    def _set_outstanding(self, param: Parameter, step: int) -> None:
        previous = self.outstanding.get(param)
        if previous is not None:
            if previous == step:
                return
            self._unindex(param, previous)
        else:
            self._outstanding_numel += param.ds_numel
        self.outstanding[param] = step
        bucket = self.outstanding_by_step.get(step)
        if bucket is None:
            self.outstanding_by_step[step] = bucket = {}
        bucket[param] = None
        if step < self._swept_below:
            self._swept_below = step

    def _drop_outstanding(self, param: Parameter) -> None:
        step = self.outstanding.pop(param, None)
        if step is not None:
            self._outstanding_numel -= param.ds_numel
            self._unindex(param, step)

    def _unindex(self, param: Parameter, step: int) -> None:
        bucket = self.outstanding_by_step[step]
        del bucket[param]
        if not bucket:
            del self.outstanding_by_step[step]

    def rebase(self, trace: PassTrace, step: int) -> List[Parameter]:
        """The pass moved to another cached trace at ``step``: walk that one from here.

        Returns the prefetched parameters the new trace does not use again; the caller releases them.
        """
        self.trace = trace
        self.cursor = 0
        self._skip_through(step)
        # Claims name steps of the old trace: drop them, and retarget what was gathered ahead.
        self.claims.clear()
        stale = []
        for param in list(self.outstanding):
            target = trace.next_use(param, step - 1)
            if target is None:
                stale.append(param)
                self._drop_outstanding(param)
            else:
                self._set_outstanding(param, target)
                self.claims[param] = target
        return stale

    def _skip_through(self, step: int) -> None:
        uses = self.trace.param_uses
        while self.cursor < len(uses) and uses[self.cursor][1] <= step:
            self.cursor += 1

    def reached(self, step: int) -> None:
        """Execution is at ``step``: what was gathered for it is in use, not ahead of use any more."""
        self._skip_through(step)
        if step < self._swept_below:
            return
        by_step = self.outstanding_by_step
        if by_step:
            for due in range(self._swept_below, step + 1):
                bucket = by_step.pop(due, None)
                if bucket is not None:
                    for param in bucket:
                        del self.outstanding[param]
                        self._outstanding_numel -= param.ds_numel
        self._swept_below = step + 1

    def holds(self, param: Parameter, step: int) -> bool:
        """Whether the walk assigned ``param`` to a step after ``step`` (so it must stay gathered)."""
        return self.claims.get(param, -1) > step

    def adopt(self, param: Parameter) -> None:
        """A claimed parameter was kept at release: count it in the window until its claimed step."""
        self._set_outstanding(param, self.claims[param])

    def forget(self, param: Parameter) -> None:
        """``param`` was released by someone else: it is no longer ahead of use."""
        self._drop_outstanding(param)
        self.claims.pop(param, None)

    def plan(self, live_numel: int, max_live_numel: int,
             stop_at: Optional[Callable[[Parameter], bool]] = None) -> List[Parameter]:
        """Parameters to gather now, in trace order, within the window and the live cap.

        The walk waits (stops without passing it) at a parameter ``stop_at`` names: an NVMe partition not read
        yet ([Note: NVMe swap-in ahead]).
        """
        budget = min(self.bucket_numel - self._outstanding_numel, max_live_numel - live_numel)
        uses = self.trace.param_uses
        if budget <= 0 or self.cursor >= len(uses):
            return []  # nothing is walked: the common case once the window is full
        chosen: List[Parameter] = []
        chosen_numel = 0
        claims = self.claims
        started_step = None  # a module is prefetched whole, so its small bias is never left to a demand fetch
        while self.cursor < len(uses) and (chosen_numel < budget or uses[self.cursor][1] == started_step):
            param, step = uses[self.cursor]
            if stop_at is not None and stop_at(param):
                break
            if chosen_numel < budget:
                started_step = step
            self.cursor += 1
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param in self.outstanding:
                if not param.ds_persist:
                    claims[param] = max(claims.get(param, -1), step)
                continue
            chosen.append(param)
            chosen_numel += param.ds_numel
            self._set_outstanding(param, step)
            claims[param] = max(claims.get(param, -1), step)
        return chosen
