"""``Residency`` ([Note: residency]): the gathered set in gather order, the parked set in first-park order, and
the live numel they add up to."""

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.capabilities import HELD_MARK_ATTR
from deepspeed_zero3.runtime.zero.residency import (Boundary, Reason, Released, Residency, releasable,
                                                    survives_table)
from deepspeed_zero3.runtime.zero.stats import ZeroStats

from zero_fakes import zparam


class RecordingGatherer:
    """The two things ``Residency.release`` asks of the gatherer: its in-flight registry, and a wait."""

    def __init__(self):
        self.inflight = {}
        self.waited = []

    def wait(self, params):
        for param in params:
            self.waited.append(param.ds_id)
            param.ds_status = ZeroParamStatus.AVAILABLE


def _residency(gatherer=None, counting=None):
    stats = ZeroStats()
    return Residency(stats, gatherer or RecordingGatherer(), counting or (lambda: stats.outside_pass)), stats


def test_gathered_keeps_gather_order_and_counts_numel_once():
    residency, stats = _residency()
    a, b, c = zparam(0, 10), zparam(1, 20), zparam(2, 30)
    residency.add([b, a])
    residency.add([c, a])  # a again: recorded once
    assert residency.gathered() == (b, a, c)
    assert residency.numel == 60 == stats.live_numel


def test_persistent_parameters_are_not_recorded():
    residency, stats = _residency()
    persistent = zparam(0, 10, persist=True)
    residency.add([persistent])
    assert residency.gathered() == () and residency.numel == 0 == stats.live_numel


def test_parked_keeps_first_park_order_when_parked_again():
    residency, _ = _residency()
    a, b, c = zparam(0, 10), zparam(1, 20), zparam(2, 30)
    residency.add([a, b, c])
    residency.park(c, Reason.REUSE)
    residency.park(a, Reason.REUSE)
    residency.park(c, Reason.FOR_BACKWARD)  # again: keeps its place (the NVMe swap room frees in this order)
    assert residency.parked() == (c, a)
    assert residency.gathered() == (a, b, c)  # parking moves nothing in gather order


def test_forget_removes_from_both_and_lowers_numel():
    residency, stats = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([a, b])
    residency.park(a, Reason.REUSE)
    residency.forget(a)
    assert residency.gathered() == (b, ) and residency.parked() == ()
    assert residency.numel == 20 == stats.live_numel
    residency.forget(a)  # twice: nothing left to remove
    assert residency.numel == 20


def test_forgetting_a_parked_parameter_not_gathered_keeps_numel():
    residency, stats = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([b])
    residency.park(a, Reason.REUSE)  # parked without a recorded gather (a getter's gather is in no record)
    residency.forget(a)
    assert residency.parked() == () and residency.gathered() == (b, )
    assert residency.numel == 20 == stats.live_numel


def test_snapshots_allow_forgetting_while_iterating():
    residency, _ = _residency()
    params = [zparam(i, 5) for i in range(4)]
    residency.add(params)
    for param in residency.parked() + residency.gathered():
        residency.forget(param)
    assert residency.gathered() == () and residency.numel == 0


def test_peak_is_recorded_in_the_running_pass():
    from deepspeed_zero3.runtime.zero.passes import PassKind

    passes = []
    residency, stats = _residency(counting=lambda: passes[-1] if passes else stats.outside_pass)
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([a])
    passes.append(stats.begin_pass(PassKind.FORWARD))
    residency.add([b])
    residency.forget(a)
    assert passes[-1].peak_live_numel == 30 and residency.numel == 20
    assert stats.outside_pass.peak_live_numel == 10


def test_reparking_changes_the_reason_except_for_the_next_eval():
    residency, _ = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([a, b])
    residency.park(a, Reason.REUSE)
    residency.park(a, Reason.FOR_BACKWARD)
    assert residency.reason(a) is Reason.FOR_BACKWARD
    residency.park(b, Reason.FOR_NEXT_EVAL)
    residency.park(b, Reason.REUSE)  # a silent pass re-parking the carry leaves it the carry
    assert residency.reason(b) is Reason.FOR_NEXT_EVAL
    assert residency.reason(zparam(2, 1)) is None


def test_settle_sets_the_reason_of_parked_survivors_only():
    residency, _ = _residency()
    a, b, c = zparam(0, 10), zparam(1, 20), zparam(2, 30)
    residency.add([a, b, c])
    residency.park(a, Reason.FOR_NEXT_EVAL)
    residency.park(b, Reason.REUSE)
    residency.settle([a, b, c], Reason.FOR_BACKWARD)  # c is gathered, not parked: it stays unparked
    assert [residency.reason(p) for p in (a, b, c)] == [Reason.FOR_BACKWARD, Reason.FOR_BACKWARD, None]
    assert residency.parked() == (a, b)


def test_forgetting_the_traces_demotes_the_carry_to_reuse():
    residency, _ = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([a, b])
    residency.park(a, Reason.FOR_NEXT_EVAL)
    residency.park(b, Reason.FOR_BACKWARD)
    residency.demote_next_eval()
    assert residency.reason(a) is Reason.REUSE and residency.reason(b) is Reason.FOR_BACKWARD
    residency.park(a, Reason.REUSE)
    assert residency.parked() == (a, b)


def test_numel_by_reason_splits_the_live_numel():
    residency, _ = _residency()
    reuse, carried, carried2, in_use, held, ahead = (zparam(i, 10 * (i + 1)) for i in range(6))
    residency.add([reuse, carried, carried2, in_use, held, ahead])
    residency.park(reuse, Reason.REUSE)
    residency.park(carried, Reason.FOR_NEXT_EVAL)
    residency.park(carried2, Reason.FOR_NEXT_EVAL)
    in_use.ds_active_sub_modules.add(7)
    setattr(held, HELD_MARK_ATTR, 1)
    residency.park(zparam(9, 1000), Reason.REUSE)  # parked, not gathered: not live, so in no key
    numel = residency.numel_by_reason()
    assert numel == {"reuse": 10, "for_backward": 0, "for_next_eval": 50, "stream": 0, "getter": 0, "in_use": 40, "held": 50,
                     "ahead": 60}
    assert sum(numel.values()) == residency.numel


def ids(params):
    return [param.ds_id for param in params]


def _parked_three():
    residency, _ = _residency()
    params = [zparam(i, 10) for i in range(4)]
    residency.add(params)
    a, b, c, d = params
    residency.park(c, Reason.FOR_NEXT_EVAL)
    residency.park(a, Reason.REUSE)
    residency.park(b, Reason.FOR_BACKWARD)
    return residency, params


def test_a_forwards_end_keeps_what_the_backward_uses_for_the_backward():
    residency, (a, b, c, d) = _parked_three()
    assert ids(residency.cross(Boundary.FORWARD_ENDS, {a, c}.__contains__)) == [2, 0]  # park order
    assert [residency.reason(p) for p in (a, b, c)] == [Reason.FOR_BACKWARD, Reason.FOR_BACKWARD,
                                                        Reason.FOR_BACKWARD]
    # b did not qualify: the caller releases it (and d, gathered but never parked)
    residency, (a, b, c, d) = _parked_three()
    assert residency.cross(Boundary.FORWARD_ENDS, None) == ()  # no expected backward: nothing qualifies


def test_an_eval_forwards_end_keeps_the_plan_for_the_next_eval():
    residency, (a, b, c, d) = _parked_three()
    assert ids(residency.cross(Boundary.EVAL_FORWARD_ENDS, {a, b}.__contains__)) == [0, 1]
    assert residency.reason(a) is Reason.FOR_NEXT_EVAL and residency.reason(b) is Reason.FOR_NEXT_EVAL


def test_a_forward_begins_keeping_the_carry_only():
    residency, (a, b, c, d) = _parked_three()
    assert ids(residency.cross(Boundary.FORWARD_BEGINS)) == [2]
    assert residency.reason(c) is Reason.FOR_NEXT_EVAL and residency.reason(a) is Reason.REUSE


def test_nothing_survives_a_backwards_end_or_a_reset():
    for boundary in (Boundary.BACKWARD_ENDS, Boundary.RESET):
        residency, _ = _parked_three()
        assert residency.cross(boundary, lambda p: True) == ()


def test_the_table_is_quoted_verbatim_in_the_note_and_in_design_md():
    import pathlib

    from deepspeed_zero3.runtime.zero import residency as module

    lines = survives_table()
    assert len(lines) == 2 + len(Boundary)
    note = [line.strip() for line in module.__doc__.splitlines()]
    start = note.index(lines[0])
    assert note[start:start + len(lines)] == lines
    design = pathlib.Path(__file__).resolve().parents[2] / "docs" / "design.md"
    text = design.read_text().splitlines()
    start = text.index(lines[0])
    assert text[start:start + len(lines)] == lines


def _gathered(residency, *params):
    for param in params:
        param.ds_status = ZeroParamStatus.AVAILABLE
    residency.add(params)
    return params


def test_releasable_means_unused_and_not_held():
    free, in_use, held = (zparam(i, 10, status=ZeroParamStatus.AVAILABLE) for i in range(3))
    in_use.ds_active_sub_modules.add(5)
    setattr(held, HELD_MARK_ATTR, 1)
    assert [releasable(p) for p in (free, in_use, held)] == [True, False, False]


def test_release_partitions_an_unused_parameter_and_forgets_it():
    residency, stats = _residency()
    a, b = _gathered(residency, zparam(0, 10), zparam(1, 20))
    residency.park(a, Reason.REUSE)
    partitioned = []
    assert residency.release(a, partition=lambda p: partitioned.append(p.ds_id)) is Released.PARTITIONED
    assert partitioned == [0] and residency.gathered() == (b, ) and residency.parked() == ()
    assert residency.numel == 20 == stats.live_numel


def test_release_leaves_a_held_parameter_exactly_as_it_is():
    gatherer = RecordingGatherer()
    residency, _ = _residency(gatherer)
    (a, ) = _gathered(residency, zparam(0, 10))
    residency.park(a, Reason.FOR_BACKWARD)
    gatherer.inflight[a] = "handle"
    setattr(a, HELD_MARK_ATTR, 1)
    assert residency.release(a, partition=lambda p: None) is Released.HELD
    assert residency.parked() == (a, ) and residency.gathered() == (a, ) and a in gatherer.inflight


def test_release_leaves_a_parameter_in_use_gathered_and_recorded():
    residency, _ = _residency()
    (a, ) = _gathered(residency, zparam(0, 10))
    a.ds_active_sub_modules.add(3)
    assert residency.release(a, partition=lambda p: 1 / 0) is Released.IN_USE
    assert residency.gathered() == (a, ) and residency.recorded(a) and a.ds_status == ZeroParamStatus.AVAILABLE


def test_release_completes_a_gather_in_flight_and_unregisters_it():
    gatherer = RecordingGatherer()
    residency, _ = _residency(gatherer)
    a, b = zparam(0, 10, status=ZeroParamStatus.INFLIGHT), zparam(1, 10, status=ZeroParamStatus.AVAILABLE)
    residency.add([a, b])
    gatherer.inflight.update({a: "handle", b: "completed by a coalesced sibling, still registered"})
    partitioned = []
    for param in (a, b):
        assert residency.release(param, partition=lambda p: partitioned.append(p.ds_id)) is Released.PARTITIONED
    assert gatherer.waited == [0] and partitioned == [0, 1] and gatherer.inflight == {}
