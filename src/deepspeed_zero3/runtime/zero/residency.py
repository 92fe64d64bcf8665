"""What a coordinator holds gathered, and which of it stays gathered on purpose.

[Note: residency]
One ``Residency`` per coordinator answers "why is this parameter gathered right now?".
* ``gathered()``: every non-persistent parameter this coordinator gathered and has not released,
  in gather order. Its numel is ``live_numel``, the figure ``stage3_max_live_parameters`` caps
  and ``get_zero3_stats`` reports; each change is told to the stats, which keep the peaks.
* ``parked()``: of those, the ones no module uses now that stay gathered on purpose, in the
  order they were first parked: for a later use in the running pass (the reuse distance), or
  past its end for the next pass ([Note: budgeted keeping], [Note: keeping across no-grad
  passes]). Parking a parked parameter again keeps its place, so the NVMe swap room frees in
  the order parameters were parked, as before this object existed.
* Persistent parameters are never recorded: they stay gathered for good and count toward no cap.
* ``forget`` is the one way out of both, used wherever a parameter is partitioned; forgetting a
  parameter parked but not gathered is allowed and leaves the numel unchanged.
Upstream's own records stay where they are and are asked, never copied: ``ds_status``,
``ds_active_sub_modules``, the in-flight registry, ``ds_persist``.
"""

from typing import Dict, Iterable, Tuple

from torch.nn import Parameter

from deepspeed_zero3.runtime.zero.stats import ZeroStats


class Residency:
    """[Note: residency]: the gathered parameters of one coordinator, and the parked ones among them."""

    def __init__(self, stats: ZeroStats):
        self._stats = stats
        self._gathered: Dict[Parameter, None] = {}  # an ordered set, gather order
        self._parked: Dict[Parameter, None] = {}  # an ordered set, first-park order
        self.numel = 0

    def add(self, params: Iterable[Parameter]) -> None:
        """``params`` were just gathered (or submitted): record the non-persistent ones not recorded yet."""
        for param in params:
            if not param.ds_persist and param not in self._gathered:
                self._gathered[param] = None
                self._changed(param.ds_numel)

    def park(self, param: Parameter) -> None:
        """``param`` stays gathered on purpose though no module uses it now."""
        self._parked[param] = None

    def forget(self, param: Parameter) -> None:
        """``param`` is partitioned (or about to be): out of both records."""
        self._parked.pop(param, None)
        if param in self._gathered:
            del self._gathered[param]
            self._changed(-param.ds_numel)

    def gathered(self) -> Tuple[Parameter, ...]:
        """The recorded gathered parameters, in gather order (a snapshot: releasing while iterating is safe)."""
        return tuple(self._gathered)

    def parked(self) -> Tuple[Parameter, ...]:
        """The parked parameters, in first-park order (a snapshot)."""
        return tuple(self._parked)

    def _changed(self, delta: int) -> None:
        self.numel += delta
        self._stats.on_live_change(delta)
