"""ZeROOrderedDict under DeepCompile's ZeRO-3 eager fallback, and while Dynamo compiles.

DeepCompile itself does not run on CPU (its ``dc`` op includes ATen/cuda headers); the parity scenario
``deepcompile_eager_fallback`` runs the fallback over real engines. These are its branches one by one, on a
stand-in parameter whose gather is counted.
"""

import pytest
import torch
from torch import nn

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

# The fallback exists from deepspeed 0.19.3, its guard check from 0.19.4; before, the getter gathers as
# upstream's did (the rest of the suite covers that).
z3_eager_fallback = pytest.importorskip("deepspeed.compile.z3_eager_fallback",
                                        reason="this deepspeed release has no DeepCompile eager fallback")
if not hasattr(z3_eager_fallback, "is_dynamo_guard_evaluation"):
    pytest.skip("this deepspeed release's eager fallback has no guard check", allow_module_level=True)
DeepCompileZ3EagerFallback = z3_eager_fallback.DeepCompileZ3EagerFallback

from deepspeed_zero3.runtime.zero import parameter_offload
from deepspeed_zero3.runtime.zero.hooks import FWD_MODULE_STACK
from deepspeed_zero3.runtime.zero.ordered_dict import ZeROOrderedDict


def partitioned_module(ds_id=5):
    module = nn.Module()
    param = nn.Parameter(torch.empty(0))
    param.ds_id = ds_id
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.gathers = 0

    def all_gather():
        param.gathers += 1
        param.ds_status = ZeroParamStatus.AVAILABLE

    param.all_gather = all_gather
    params = ZeROOrderedDict(parent_module=module)
    params["weight"] = param
    params._in_forward = True
    module._parameters = params
    return module, param


@pytest.fixture(autouse=True)
def said(monkeypatch):
    """Upstream's getter line goes through parameter_offload.print_rank_0, which needs a process group."""
    lines = []
    monkeypatch.setattr(parameter_offload, "print_rank_0", lambda message, **kwargs: lines.append(message))
    return lines


@pytest.fixture
def fallback(monkeypatch):
    active = DeepCompileZ3EagerFallback(engine=None)
    monkeypatch.setattr(z3_eager_fallback, "_ACTIVE_FALLBACK", active)
    return active


def test_read_in_forward_gathers_for_the_fallback(fallback, monkeypatch):
    monkeypatch.setattr(z3_eager_fallback, "is_dynamo_guard_evaluation", lambda: False)
    module, param = partitioned_module()
    running = nn.Module()  # the module whose forward reads the parameter
    FWD_MODULE_STACK.append(running)
    try:
        assert module._parameters["weight"] is param
    finally:
        FWD_MODULE_STACK.pop()
    assert param.gathers == 1 and param.ds_status == ZeroParamStatus.AVAILABLE
    assert fallback.stats()["last_gathered_param_ids"] == [5]
    # The fallback owns the gather: the parameter is not registered as an external parameter of the running
    # module (without a fallback it would be: test_read_without_fallback_registers_it_on_the_running_module).
    assert not getattr(running, "_external_params", {})
    # A second read of the gathered parameter only marks it used by this forward.
    assert module._parameters["weight"] is param
    assert param.gathers == 1 and fallback.stats()["current_forward_param_ids"] == [5]


def test_guard_evaluation_reads_without_gathering(fallback, monkeypatch):
    monkeypatch.setattr(z3_eager_fallback, "is_dynamo_guard_evaluation", lambda: True)
    module, param = partitioned_module(ds_id=9)
    assert module._parameters["weight"] is param
    assert param.gathers == 0 and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert fallback.stats()["last_guard_suppressed_param_ids"] == [9]


def test_while_compiling_the_parameter_is_returned_untouched(fallback, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    module, param = partitioned_module()
    del param.ds_status  # no ZeRO state is read while Dynamo traces
    assert module._parameters["weight"] is param
    assert param.gathers == 0


def test_outside_forward_nothing_is_gathered(fallback):
    module, param = partitioned_module()
    module._parameters._in_forward = False
    assert module._parameters["weight"] is param
    assert param.gathers == 0 and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert fallback.stats()["last_gathered_param_ids"] == []


def test_read_without_fallback_registers_it_on_the_running_module():
    module, param = partitioned_module()
    running = nn.Module()
    FWD_MODULE_STACK.append(running)
    try:
        assert module._parameters["weight"] is param
    finally:
        FWD_MODULE_STACK.pop()
    assert param.gathers == 1 and list(running._external_params.values()) == [param]
