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
* ``add_read``: a parameter gathered outside any module's fetch, by the getter or for a returned
  parameter (reason GETTER): counted in ``numel`` like any other, so every boundary releases it.
* ``hold``/``unhold``: a weight stream's buckets (reason STREAM, [Note: streaming weights]). Held
  parameters are the stream's: marked as ``GatheredParameters`` marks its own (so no pass releases
  them and upstream refuses an overlapping context), outside ``numel`` (the stream has its own
  bound), and released by the stream alone.
* Each parked parameter has one ``Reason``. FOR_NEXT_EVAL is sticky: a silent pass re-parks what
  the last eval forward carried (as REUSE where it has a later use) and must leave the carry as it
  found it, so re-parking never changes it; only ``settle`` at a boundary (which decides afresh
  what survives, and why) or ``demote_next_eval`` (the traces it was planned from are gone) does.
* What survives each pass boundary is one table, ``SURVIVES``, crossed by one method, ``cross``
  (``survives_table()`` renders it; docs/design.md quotes it and a unit test keeps both equal):

  | boundary | survive as they are | survive if they qualify | qualify if | these become |
  |---|---|---|---|---|
  | a forward with grad ends | STREAM | REUSE, FOR_BACKWARD, FOR_NEXT_EVAL | used by the expected backward | FOR_BACKWARD |
  | an eval forward ends | STREAM | REUSE, FOR_BACKWARD, FOR_NEXT_EVAL | in the next eval's keep plan | FOR_NEXT_EVAL |
  | a forward begins, none open | FOR_NEXT_EVAL, STREAM | - | - | - |
  | a backward ends | STREAM | - | - | - |
  | step, abandon_step, an aborted pass, registry close | STREAM | - | - | - |

  Every other gathered parameter is released. A pass that ends aborted crosses the last row. A
  silent pass ([Note: silent passes]) crosses none.
* ``numel_by_reason()`` splits the live numel by why each parameter is gathered: the parked
  reasons, ``stream`` and ``getter``, then, read from upstream's records at that moment, ``in_use``
  (a module's fetch holds it), ``held`` (a ``GatheredParameters`` holds it) and ``ahead`` (gathered
  for a later module of the running pass). Its values but ``stream`` add up to ``numel``; it is
  ``get_zero3_stats``' ``live_by_reason``.
* One predicate says whether a gathered parameter may be released, ``releasable`` (no module uses
  it, no ``GatheredParameters`` holds it), and one path releases it, ``Residency.release``: held,
  it is left exactly as it is, records included; in flight, its gather is completed; in use, it
  stays gathered and recorded (its module's release comes for it); else it is partitioned if
  gathered, and forgotten. A module's release releases only what this coordinator gathered
  (``recorded``): a parameter some other code gathered (a ``GatheredParameters`` on a release
  that does not mark what it holds, a direct ``all_gather()``) is left to it, so a forward that one
  rank alone runs under such a context is silent on every release. Two places partition on their own terms, as
  upstream's contracts require: ``release_and_reset_all`` (every parameter, persistent ones too, at
  ``step()``) and the load path (``partition(has_been_updated=True)``: the loaded values become the
  partition).
* ``forget`` is the one way out of both records; forgetting a parameter parked but not gathered is
  allowed and leaves the numel unchanged.
Upstream's own records stay where they are and are asked, never copied: ``ds_status``,
``ds_active_sub_modules``, the in-flight registry, ``ds_persist``.
"""

import enum
from typing import Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple

from torch.nn import Parameter

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.capabilities import HELD_MARK_ATTR
from deepspeed_zero3.runtime.zero.gather import Gatherer
from deepspeed_zero3.runtime.zero.release import release as release_gathered
from deepspeed_zero3.runtime.zero.stats import PassStats, ZeroStats


def held_by_gathered_parameters(param: Parameter) -> bool:
    """Gathered by an open ``deepspeed.zero.GatheredParameters`` context, which partitions it when it exits.

    Such a parameter is the context's, not ours: released under it, a module that uses it again (or the
    backward that it was kept for) would gather it again, and inside the context a forward may run on one
    rank only. Upstream marks these parameters with a context depth (from 0.19.4); its own coordinator ignores it.
    """
    return getattr(param, HELD_MARK_ATTR, 0) > 0  # [Note: release capabilities]


def releasable(param: Parameter) -> bool:
    """Whether a gathered ``param`` may be released now: no module's fetch uses it and no ``GatheredParameters``
    holds it ([Note: residency]). Its status is the caller's to ask."""
    return not param.ds_active_sub_modules and not held_by_gathered_parameters(param)


class Released(enum.Enum):
    """What ``Residency.release`` did."""
    HELD = "left as it is: a GatheredParameters holds it"
    PARTITIONED = "partitioned and forgotten"
    IN_USE = "left gathered and recorded: a module uses it, and its release releases it"
    FORGOTTEN = "forgotten: not gathered"


class Reason(enum.Enum):
    """Why a parked parameter stays gathered, and what that costs in memory."""
    # A later use in the running pass within stage3_max_reuse_distance: at most the reuse distance, while live
    # numel is under stage3_max_live_parameters.
    REUSE = "reuse"
    # The expected backward's first parameters, kept past the forward's end: within the cap less one bucket
    # ([Note: budgeted keeping]).
    FOR_BACKWARD = "for_backward"
    # The next eval forward's first parameters, kept past this one's end: within the cap
    # ([Note: keeping across no-grad passes]).
    FOR_NEXT_EVAL = "for_next_eval"
    # A weight stream's buckets while its consumer reads them: at most two buckets and the largest unit
    # ([Note: streaming weights]); outside live_numel.
    STREAM = "stream"
    # Read outside its module's fetch (the getter, a returned parameter): one parameter, until the reading
    # module's release.
    GETTER = "getter"


class Boundary(enum.Enum):
    """The pass boundaries at which gathered parameters are released, all but the survivors."""
    FORWARD_ENDS = "a forward with grad ends"
    EVAL_FORWARD_ENDS = "an eval forward ends"
    FORWARD_BEGINS = "a forward begins, none open"
    BACKWARD_ENDS = "a backward ends"
    RESET = "step, abandon_step, an aborted pass, registry close"


class Survival(NamedTuple):
    """One row of ``SURVIVES``: the reasons that survive a boundary as they are; those that survive if they
    pass the boundary's test (``filtered_by`` says what it is; the boundary's caller passes it to ``cross``),
    and the reason these have past it."""
    unchanged: FrozenSet[Reason]
    filtered: FrozenSet[Reason] = frozenset()
    filtered_by: Optional[str] = None
    becomes: Optional[Reason] = None


_KEPT = frozenset({Reason.REUSE, Reason.FOR_BACKWARD, Reason.FOR_NEXT_EVAL})
_STREAM = frozenset({Reason.STREAM})

# [Note: residency]'s table, the one place that says what survives a boundary.
SURVIVES: Dict[Boundary, Survival] = {
    Boundary.FORWARD_ENDS: Survival(_STREAM, _KEPT, "used by the expected backward", Reason.FOR_BACKWARD),
    Boundary.EVAL_FORWARD_ENDS: Survival(_STREAM, _KEPT, "in the next eval's keep plan", Reason.FOR_NEXT_EVAL),
    Boundary.FORWARD_BEGINS: Survival(frozenset({Reason.FOR_NEXT_EVAL, Reason.STREAM})),
    Boundary.BACKWARD_ENDS: Survival(_STREAM),
    Boundary.RESET: Survival(_STREAM),
}

# Derived at read time, after the parked reasons, in numel_by_reason's keys.
DERIVED = ("in_use", "held", "ahead")


def survives_table() -> List[str]:
    """``SURVIVES`` as the lines of a markdown table."""
    def names(reasons):
        return ", ".join(reason.name for reason in Reason if reason in reasons) or "-"

    lines = ["| boundary | survive as they are | survive if they qualify | qualify if | these become |",
             "|---|---|---|---|---|"]
    for boundary, row in SURVIVES.items():
        becomes = row.becomes.name if row.becomes is not None else "-"
        lines.append(f"| {boundary.value} | {names(row.unchanged)} | {names(row.filtered)} | "
                     f"{row.filtered_by or '-'} | {becomes} |")
    return lines


class Residency:
    """[Note: residency]: the gathered parameters of one coordinator, and the parked ones among them."""

    def __init__(self, stats: ZeroStats, gatherer: Gatherer, counting: Callable[[], PassStats]):
        """``counting``: the counters a change of the gathered numel is a peak for (the running pass's, or
        ``stats.outside_pass`` between passes)."""
        self._stats = stats
        self._counting = counting
        self._gatherer = gatherer
        self._gathered: Dict[Parameter, None] = {}  # an ordered set, gather order
        self._parked: Dict[Parameter, Reason] = {}  # first-park order
        self._streamed: Dict[Parameter, int] = {}  # held by weight streams (how many), first-hold order
        self._read: Dict[Parameter, None] = {}  # gathered by a read outside a fetch (an ordered set)

    def add(self, params: Iterable[Parameter]) -> None:
        """``params`` were just gathered (or submitted): record the non-persistent ones not recorded yet."""
        for param in params:
            if not param.ds_persist and param not in self._gathered:
                self._gathered[param] = None
                self._changed(param.ds_numel)

    def add_read(self, param: Parameter) -> None:
        """``param`` was just gathered for a read outside any module's fetch (reason GETTER)."""
        self.add((param, ))
        if param in self._gathered:
            self._read[param] = None

    def park(self, param: Parameter, reason: Reason) -> None:
        """``param`` stays gathered for ``reason`` though no module uses it now (FOR_NEXT_EVAL is sticky)."""
        if self._parked.get(param) is not Reason.FOR_NEXT_EVAL:
            self._parked[param] = reason

    def settle(self, params: Iterable[Parameter], reason: Reason) -> None:
        """At a pass boundary: ``params`` (parked ones) stay gathered past it, now for ``reason``."""
        for param in params:
            if param in self._parked:
                self._parked[param] = reason

    def cross(self, boundary: Boundary,
              qualifying: Optional[Callable[[Parameter], bool]] = None) -> Tuple[Parameter, ...]:
        """The parked parameters that survive ``boundary`` (``SURVIVES``), in park order, settled to the reason
        they have past it; ``qualifying``: the boundary's filter, for a row that has one (None: nothing
        qualifies, as when a forward has no expected backward or an eval forward no trace). The caller releases
        every other gathered parameter."""
        row = SURVIVES[boundary]
        qualified = tuple(param for param, reason in self._parked.items()
                          if reason in row.filtered and qualifying is not None and qualifying(param))
        if row.becomes is not None:
            self.settle(qualified, row.becomes)
        qualified = set(qualified)  # Parameters hash by identity
        return tuple(param for param, reason in self._parked.items()
                     if reason in row.unchanged or param in qualified)

    def demote_next_eval(self) -> None:
        """The traces a carry was planned from are forgotten: what it kept is kept for no next pass any more,
        and the next boundary releases it."""
        for param, reason in self._parked.items():
            if reason is Reason.FOR_NEXT_EVAL:
                self._parked[param] = Reason.REUSE

    def reason(self, param: Parameter):
        """Why ``param`` is parked, None if it is not."""
        return self._parked.get(param)

    def forget(self, param: Parameter) -> None:
        """``param`` is partitioned (or about to be): out of both records."""
        self._parked.pop(param, None)
        self._read.pop(param, None)
        if param in self._gathered:
            del self._gathered[param]
            self._changed(-param.ds_numel)

    def hold(self, param: Parameter) -> None:
        """A weight stream gathered ``param`` for a bucket: it is the stream's until ``unhold`` (reason STREAM).
        Marked as ``GatheredParameters`` marks its own, so upstream's context mark says so to every reader."""
        self._streamed[param] = self._streamed.get(param, 0) + 1
        setattr(param, HELD_MARK_ATTR, getattr(param, HELD_MARK_ATTR, 0) + 1)

    def unhold(self, param: Parameter) -> None:
        """The stream is done with ``param`` (it releases it next, through ``release``)."""
        count = self._streamed.get(param, 0) - 1
        if count > 0:
            self._streamed[param] = count
        else:
            self._streamed.pop(param, None)
        depth = getattr(param, HELD_MARK_ATTR, 0) - 1
        if depth > 0:
            setattr(param, HELD_MARK_ATTR, depth)
        elif hasattr(param, HELD_MARK_ATTR):
            delattr(param, HELD_MARK_ATTR)

    def release(self, param: Parameter, partition: Optional[Callable[[Parameter], None]] = None) -> Released:
        """The one release path ([Note: residency]); ``partition``: how to partition ``param`` if not as
        ``param.partition()`` does (fast leaf sharding)."""
        if held_by_gathered_parameters(param):
            # Left exactly as it is, records included: the context partitions it at its exit on every rank, and
            # whatever we kept it for stays counted the same way on every rank.
            return Released.HELD
        if param.ds_status == ZeroParamStatus.INFLIGHT:
            self._gatherer.wait([param])
        # One coalesced handle covers several modules' parameters; a sibling's wait completed this one but
        # left it registered. Released unregistered, it would be refused as "in flight" at its next gather.
        self._gatherer.inflight.pop(param, None)
        outcome = Released.FORGOTTEN
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            if param.ds_active_sub_modules:
                return Released.IN_USE  # still ours: the module's own release comes for it
            (partition or release_gathered)(param)  # [Note: releasing a gathered parameter]
            outcome = Released.PARTITIONED
        self.forget(param)
        return outcome

    def recorded(self, param: Parameter) -> bool:
        """Whether this coordinator gathered ``param`` and has not released it: only those are its to release
        ([Note: residency])."""
        return param in self._gathered

    def gathered(self) -> Tuple[Parameter, ...]:
        """The recorded gathered parameters, in gather order (a snapshot: releasing while iterating is safe)."""
        return tuple(self._gathered)

    def parked(self) -> Tuple[Parameter, ...]:
        """The parked parameters, in first-park order (a snapshot)."""
        return tuple(self._parked)

    def numel_by_reason(self) -> Dict[str, int]:
        """The live numel by why it is gathered ([Note: residency]); every key present, zero included."""
        numel = dict.fromkeys([reason.value for reason in Reason] + list(DERIVED), 0)
        numel[Reason.STREAM.value] = sum(param.ds_numel for param in self._streamed)
        for param in self._gathered:
            if param.ds_active_sub_modules:
                why = "in_use"
            elif param in self._parked:
                why = self._parked[param].value
            elif held_by_gathered_parameters(param):
                why = "held"
            elif param in self._read:
                why = Reason.GETTER.value
            else:
                why = "ahead"
            numel[why] += param.ds_numel
        return numel

    @property
    def numel(self) -> int:
        """The gathered set's numel, ``live_numel``: one count, kept by the stats with its peaks."""
        return self._stats.live_numel

    def _changed(self, delta: int) -> None:
        self._stats.on_live_change(delta, self._counting())
