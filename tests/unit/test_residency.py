"""``Residency`` ([Note: residency]): the gathered set in gather order, the parked set in first-park order, and
the live numel they add up to."""

from deepspeed_zero3.runtime.zero.residency import Residency
from deepspeed_zero3.runtime.zero.stats import ZeroStats

from zero_fakes import zparam


def _residency():
    stats = ZeroStats()
    return Residency(stats), stats


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
    residency.park(c)
    residency.park(a)
    residency.park(c)  # again: keeps its place (the NVMe swap room frees in this order)
    assert residency.parked() == (c, a)
    assert residency.gathered() == (a, b, c)  # parking moves nothing in gather order


def test_forget_removes_from_both_and_lowers_numel():
    residency, stats = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([a, b])
    residency.park(a)
    residency.forget(a)
    assert residency.gathered() == (b, ) and residency.parked() == ()
    assert residency.numel == 20 == stats.live_numel
    residency.forget(a)  # twice: nothing left to remove
    assert residency.numel == 20


def test_forgetting_a_parked_parameter_not_gathered_keeps_numel():
    residency, stats = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    residency.add([b])
    residency.park(a)  # parked without a recorded gather (a getter's gather is in no record)
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

    residency, stats = _residency()
    a, b = zparam(0, 10), zparam(1, 20)
    running = stats.begin_pass(PassKind.FORWARD)
    residency.add([a, b])
    residency.forget(a)
    assert running.peak_live_numel == 30 and residency.numel == 20
