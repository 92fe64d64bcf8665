"""[Note: profiler ranges]: named ranges under a profiler, one shared no-op (and no label built) without."""

import torch

from deepspeed_zero3.runtime.zero import profiling
from zero_fakes import zmodule, zparam


class Unformattable:
    """A module stand-in whose label cannot be built: touching it for a label fails the test."""

    @property
    def ds_id(self):
        raise AssertionError("the label was built with no profiler running")


def test_no_profiler_no_label_and_one_shared_no_op():
    assert profiling.module_range("fetch", Unformattable()) is profiling.module_range("release", Unformattable())
    assert profiling.pass_range("prefetch", " backward start", [zparam(1, 3)]) is profiling._NO_RANGE


def test_ranges_are_named_by_module_class_and_ds_id_under_a_profiler():
    module = zmodule(7, zparam(1, 3), zparam(2, 4))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiling.module_range("fetch", module, " forward"):
            with profiling.module_range("prefetch", module, params=list(module.parameters())):
                pass
        with profiling.pass_range("prefetch", " backward start", [zparam(3, 5)]):
            pass
    names = {event.name for event in prof.events()}
    assert {"ZeRO3::fetch ZModule ds_id=7 forward", "ZeRO3::prefetch ZModule ds_id=7 (2 params, 7 numel)",
            "ZeRO3::prefetch backward start (1 params, 5 numel)"} <= names
