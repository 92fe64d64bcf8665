"""InflightParamRegistry (a checked dict) and Gatherer.submit's grouping, with fake parameters and handles."""

import collections

import pytest
import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.gather import Gatherer, InflightParamRegistry
from zero_fakes import zparam

INFLIGHT = ZeroParamStatus.INFLIGHT
AVAILABLE = ZeroParamStatus.AVAILABLE


def gatherable(ds_id, quantized=False, secondary=False, status=ZeroParamStatus.NOT_AVAILABLE, calls=None):
    """A parameter whose ``all_gather_coalesced`` records the group it was called with and marks it in flight."""
    param = zparam(ds_id, 4, status=status)
    param.ds_shape = (4, )
    param.ds_tensor = torch.zeros(2)
    if quantized:
        param.ds_tensor.ds_quant_scale = torch.ones(1)
    param.ds_secondary_tensor = torch.zeros(1) if secondary else None

    def all_gather_coalesced(group, quantize=False):
        calls.append(([p.ds_id for p in group], quantize))
        for p in group:
            p.ds_status = INFLIGHT
        return f"handle{len(calls)}"

    param.all_gather_coalesced = all_gather_coalesced
    return param


def test_registry_is_a_checked_dict():
    registry = InflightParamRegistry()
    param = gatherable(1, status=INFLIGHT)
    registry[param] = "h"
    assert isinstance(registry, dict) and registry.data is registry
    assert registry.pop(gatherable(2), None) is None  # a missing key: no KeyError anywhere on this path
    with pytest.raises(RuntimeError, match="ds_id=1 shape=\\(4,\\) is already in flight"):
        registry[param] = "again"
    for add in (lambda r, p: r.update({p: "h"}), lambda r, p: r.setdefault(p, "h"), lambda r, p: r.__ior__({p: "h"})):
        with pytest.raises(RuntimeError, match="only an in-flight parameter can be registered, got ds_id=3 "
                           "with status AVAILABLE"):
            add(registry, gatherable(3, status=AVAILABLE))
    with pytest.raises(RuntimeError, match="got ds_id=4 with status AVAILABLE"):
        InflightParamRegistry({gatherable(4, status=AVAILABLE): "h"})
    assert list(registry) == [param]
    copy = registry.copy()
    assert isinstance(copy, InflightParamRegistry) and copy == {param: "h"}
    assert registry.pop(param) == "h" and not registry


def test_submit_returns_at_once_when_nothing_is_partitioned():
    calls = []
    params = [gatherable(i, status=AVAILABLE, calls=calls) for i in range(3)]
    gatherer = Gatherer(None, InflightParamRegistry())
    assert gatherer.submit(params) == []
    assert gatherer.submit(iter(params)) == []
    assert calls == [] and not gatherer.inflight


def test_submit_groups_by_quantization_and_secondary_partition_in_order():
    calls = []
    params = [
        gatherable(0, calls=calls),
        gatherable(1, secondary=True, calls=calls),
        gatherable(2, quantized=True, calls=calls),
        gatherable(3, status=AVAILABLE, calls=calls),
        gatherable(4, quantized=True, secondary=True, calls=calls),
        gatherable(5, calls=calls),
        gatherable(6, secondary=True, calls=calls),
    ]
    gatherer = Gatherer(None, InflightParamRegistry(), quantize_weights=False)
    issued = gatherer.submit(params)
    # Quantized (with a secondary partition, then without), then plain (with, then without).
    assert calls == [([4], True), ([2], True), ([1, 6], False), ([0, 5], False)]
    assert [[p.ds_id for p in group] for group in issued] == [[4], [2], [1, 6], [0, 5]]
    handles = collections.Counter(gatherer.inflight.values())
    assert handles == {"handle1": 1, "handle2": 1, "handle3": 2, "handle4": 2}
    assert params[3] not in gatherer.inflight


def test_submit_quantizes_plain_parameters_under_quantized_weights():
    calls = []
    gatherer = Gatherer(None, InflightParamRegistry(), quantize_weights=True)
    gatherer.submit([gatherable(0, calls=calls)])
    assert calls == [([0], True)]


def test_submit_calls_before_once_ahead_of_the_first_collective_and_only_if_there_is_one():
    calls, seen = [], []
    gatherer = Gatherer(None, InflightParamRegistry())
    gatherer.submit([gatherable(0, status=AVAILABLE, calls=calls)], before=lambda: seen.append(len(calls)))
    assert seen == []  # nothing to gather: no collective, no call
    gatherer.submit([gatherable(1, calls=calls), gatherable(2, quantized=True, calls=calls)],
                    before=lambda: seen.append(len(calls)))
    assert seen == [0] and len(calls) == 2  # once, before either of the two collectives
