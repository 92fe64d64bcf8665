"""Why a parameter a module releases stays gathered: one rule per pass, rebuilt when its trace switches.

[Note: a keep rule per pass]
At each release the coordinator asks whether a parameter stays gathered, and why ([Note: residency]).
The facts that decide it are the pass's kind, the trace it replays and, for a forward with grad,
the backward it keeps for ([Note: budgeted keeping]). They change only when a pass begins and when
its replayed trace switches or is left ([Note: trace selection]), never per parameter. So the
coordinator builds a ``KeepRule`` at those moments and every release asks it, each call going
down only: rule, keep plan, trace. The expected backward is worked out once per rule, not once
per released parameter, and nothing calls back into the coordinator or the prediction.
"""

from typing import Optional

from torch.nn import Parameter

from deepspeed_zero3.runtime.zero.keeping import BackwardKeeping
from deepspeed_zero3.runtime.zero.nograd_keeping import NoGradKeeping
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.residency import Reason
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.trace import PassTrace


class KeepRule:
    """[Note: a keep rule per pass]: ``trace`` is the trace the pass replays (None while it records: nothing
    is kept); ``following`` the backward a forward with grad keeps for (None: none)."""

    def __init__(self, kind: Optional[PassKind], trace: Optional[PassTrace], following: Optional[PassTrace],
                 keeping: BackwardKeeping, nograd_keeping: NoGradKeeping):
        self.kind = kind
        self.trace = trace
        self.following = following
        self.keeping = keeping
        self.nograd_keeping = nograd_keeping

    def reason(self, param: Parameter, step: int, live_numel: int, settings: PrefetchSettings) -> Optional[Reason]:
        """Why ``param``, released after ``step``, stays gathered, if it does: for the backward ([Note: budgeted
        keeping]), for the next eval forward ([Note: keeping across no-grad passes]), or for its next use in this
        pass within the reuse distance while ``live_numel`` is within the cap."""
        trace = self.trace
        if trace is None:
            return None
        if self.kind is PassKind.FORWARD and self.keeping.keeps(param, step, trace, self.following, settings):
            return Reason.FOR_BACKWARD  # at reuse 0 too: what the backward's first window gathers again
        if self.kind is PassKind.EVAL_FORWARD and self.nograd_keeping.keeps(param, step, trace, settings):
            return Reason.FOR_NEXT_EVAL
        limit = settings.max_reuse_numel
        if limit == 0 or live_numel > settings.max_live_numel:
            return None
        next_step = trace.next_use(param, step)
        if next_step is not None and trace.numel_between(step + 1, next_step) < limit:
            return Reason.REUSE
        return None
