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
* What an eval forward keeps past its end survives the start of the next forward, eval or
  training (which uses it), and nothing else: the rows of [Note: residency]'s table (residency.py)
  for an eval forward's end and a forward's beginning. A silent pass crosses no boundary and leaves
  it as it found it. ``GatheredParameters`` partitions every parameter of its list at its exit,
  and a ``load_state_dict`` post-hook makes what a loader wrote into a kept parameter its partition
  (upstream's loaders gather only partitioned ones): no stale copy survives either.
"""

from typing import FrozenSet

from torch.nn import Parameter

from deepspeed_zero3.runtime.zero.keeping import KeepPlan
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.trace import PassTrace


class NoGradKeeping:
    """[Note: keeping across no-grad passes]: the keep plan of the running eval forward."""

    def __init__(self):
        self.plan = KeepPlan()

    def planned(self, trace: PassTrace, settings: PrefetchSettings) -> FrozenSet[Parameter]:
        """What an eval forward replaying ``trace`` keeps gathered for the next one."""
        return self.plan.planned(trace, trace, settings.max_reuse_numel, settings.max_live_numel)

    def keeps(self, param: Parameter, step: int, trace: PassTrace, settings: PrefetchSettings) -> bool:
        """Whether ``param``, released after ``step`` of ``trace``, stays gathered for the next eval forward."""
        return self.plan.keeps(param, step, trace, trace, settings.max_reuse_numel, settings.max_live_numel)

    def clear(self) -> None:
        self.plan.clear()
