"""What a forward with grad leaves gathered for its backward.

[Note: budgeted keeping]
A parameter released after its last forward use and gathered again in the backward
costs a second all-gather; keeping it costs memory until the backward uses it. The
backward runs roughly the forward in reverse, so the forward's tail is needed first.
* Rule: walk the expected backward from its start and keep each parameter whose
  reuse distance (numel fetched from its last forward use to its first backward use)
  is under max(``stage3_max_reuse_distance``, one bucket), while the kept numel fits
  in ``stage3_max_live_parameters`` - one bucket; stop at the first that does not.
* One bucket even at reuse 0: the backward's first window would gather it again at
  once, so releasing it saves no memory there and costs a gather.
* Invariant: what is kept is a tail of the forward, and the reserved bucket keeps both
  prefetch windows whole, so the peak stays under cap + bucket + the largest module.
* Only the forward a backward follows keeps: the n-th forward with grad since the last
  backward keeps if the last backward after this trace came after n forwards (1 until
  one has). Silent forwards ([Note: silent passes]) are not counted.
* What it kept survives the forward's end if the expected backward uses it, and no boundary after
  that backward's end ([Note: residency]'s table).
"""

from typing import FrozenSet, Optional

from torch.nn import Parameter

from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.trace import PassTrace


def plan_kept(ending: PassTrace, following: Optional[PassTrace], reuse_limit: int, room: int) -> FrozenSet[Parameter]:
    """The parameters a pass replaying ``ending`` keeps gathered for ``following``: from ``following``'s start,
    each non-persistent parameter ``ending`` uses whose distance is under ``reuse_limit``, while the kept numel
    fits in ``room``; the walk stops at the first parameter that does not qualify."""
    if following is None or room <= 0 or reuse_limit <= 0:
        return frozenset()
    kept = set()
    kept_numel = 0
    ending_len = len(ending)
    for param, step in following.param_uses:
        if param in kept or param.ds_persist:
            continue
        last = ending.last_use(param)
        if last is None:
            continue  # used by the following pass only (recomputation): nothing to keep
        distance = ending.numel_between(last + 1, ending_len) + following.numel_between(0, step)
        if distance >= reuse_limit or kept_numel + param.ds_numel > room:
            break
        kept.add(param)
        kept_numel += param.ds_numel
    return frozenset(kept)


class KeepPlan:
    """One keep plan, made again only when its traces or its limits change."""

    def __init__(self):
        self._key = None
        self._kept: FrozenSet[Parameter] = frozenset()
        self._traces = None

    def planned(self, ending: PassTrace, following: Optional[PassTrace], reuse_limit: int,
                room: int) -> FrozenSet[Parameter]:
        key = (id(ending), id(following), reuse_limit, room)
        if key != self._key:
            self._kept = plan_kept(ending, following, reuse_limit, room)
            self._key = key
            self._traces = (ending, following)  # the ids in the key stay valid while the plan is cached
        return self._kept

    def keeps(self, param: Parameter, step: int, ending: PassTrace, following: Optional[PassTrace],
              reuse_limit: int, room: int) -> bool:
        """Whether ``param``, released after ``step`` of ``ending``, stays gathered for ``following``."""
        if ending.next_use(param, step) is not None:
            return False  # not its last use in this pass
        return param in self.planned(ending, following, reuse_limit, room)

    def clear(self) -> None:
        self._key = None
        self._kept = frozenset()
        self._traces = None


class BackwardKeeping:
    """[Note: budgeted keeping]: what the running forward keeps, and which forward the next backward follows."""

    def __init__(self):
        self.plan = KeepPlan()
        # The forward trace whose backward has not run yet: its backward trace is that backward's best guess.
        self.awaiting: Optional[PassTrace] = None
        # Forwards with grad that ended since the last backward ended (silent ones excluded).
        self.forwards = 0

    def follows(self, forward: PassTrace) -> bool:
        """Whether the running forward, replaying ``forward``, is the one a backward followed last time (so it
        keeps for that backward)."""
        return self.forwards + 1 == forward.forwards_per_backward

    def kept_for(self, forward: Optional[PassTrace], prediction) -> Optional[PassTrace]:
        """The backward a forward with grad replaying ``forward`` keeps for, if any (``prediction``: the
        coordinator's ``PassPrediction``, which knows the expected backward)."""
        if forward is None or not self.follows(forward):
            return None
        return prediction.expected_backward(forward)

    def keeps(self, param: Parameter, step: int, forward: PassTrace, backward: Optional[PassTrace],
              settings: PrefetchSettings) -> bool:
        return self.plan.keeps(param, step, forward, backward, max(settings.max_reuse_numel, settings.bucket_numel),
                               settings.max_live_numel - settings.bucket_numel)

    def forward_ended(self, trace: Optional[PassTrace]) -> None:
        """A forward with grad ended (not silent; aborted ones too, with no trace)."""
        self.awaiting = trace
        self.forwards += 1

    def backward_ended(self, trace: Optional[PassTrace]) -> None:
        """Link the forward the backward followed to it ([Note: first-pass prediction]), and start counting again."""
        if self.awaiting is not None and trace is not None:
            self.awaiting.next_backward = trace
            self.awaiting.forwards_per_backward = max(1, self.forwards)
        self.awaiting = None
        self.forwards = 0

    def abandon(self) -> None:
        """``abandon_step``: the abandoned forwards reach no backward; the next forward is the first again."""
        self.forwards = 0

    def clear(self) -> None:
        self.plan.clear()
        self.awaiting = None
