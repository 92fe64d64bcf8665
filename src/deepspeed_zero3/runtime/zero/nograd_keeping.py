"""What a forward without grad leaves gathered for the next one (a generate() loop: one pass per token).

[Note: keeping across no-grad passes]
Each generated token is a no-grad forward over the same modules in the same order; released at
its end, every parameter is gathered again for the next token.
* Rule: an eval forward replaying a trace keeps gathered, for the next one (which replays the
  same trace), the trace's first parameters, walked in order while each one's reuse distance
  (numel fetched from its last use here to its first use next) is under
  ``stage3_max_reuse_distance`` and the kept numel fits in ``stage3_max_live_parameters``. The
  rest is gathered each pass, prefetched within the room the cap leaves, else module by module.
  No window is reserved: the kept prefix stays gathered through the whole next pass, so any
  numel held back for a window would be gathered again every token.
* So at the defaults a generate() call gathers the model once; under a cap C the peak stays
  under C + the module in use; at reuse 0 nothing is kept.
* The carry survives the start of the next forward, eval or training (which uses it); the end of
  any other non-silent pass and ``reset_step`` (optimizer step, checkpoint load, ``offload_states``)
  release it. ``GatheredParameters`` partitions every parameter of its list at its exit, and a
  ``load_state_dict`` post-hook makes what a loader wrote into a kept parameter its partition
  (upstream's loaders gather only partitioned ones): no stale copy survives either.
"""

from typing import FrozenSet, Iterable, Tuple

from torch.nn import Parameter

from deepspeed_zero3.runtime.zero.keeping import KeepPlan
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.trace import PassTrace


class NoGradKeeping:
    """[Note: keeping across no-grad passes]: the plan of the running eval forward, and what the last one carried."""

    def __init__(self):
        self.plan = KeepPlan()
        # Gathered parameters the last eval forward left for the next forward; empty once another pass ended.
        self.carry: FrozenSet[Parameter] = frozenset()

    def kept(self, trace: PassTrace, settings: PrefetchSettings) -> FrozenSet[Parameter]:
        return self.plan.kept(trace, trace, settings.max_reuse_numel, settings.max_live_numel)

    def keeps(self, param: Parameter, step: int, trace: PassTrace, settings: PrefetchSettings) -> bool:
        """Whether ``param``, released after ``step`` of ``trace``, stays gathered for the next eval forward."""
        return self.plan.keeps(param, step, trace, trace, settings.max_reuse_numel, settings.max_live_numel)

    def pass_ended(self, gathered: Iterable[Parameter], trace: PassTrace, settings: PrefetchSettings) -> Tuple[Parameter, ...]:
        """An eval forward ended having run ``trace``: of ``gathered``, what it carries to the next forward."""
        plan = self.kept(trace, settings)
        carried = tuple(p for p in gathered if p in plan)
        self.carry = frozenset(carried)
        return carried

    def drop(self) -> None:
        """Another pass ended, or everything is being released: nothing is carried any more."""
        self.carry = frozenset()

    def clear(self) -> None:
        self.plan.clear()
        self.carry = frozenset()
