"""PassTrace.params_at: a replayed step reuses the recorded parameter list only while it is still what
fetch_params would return ([Note: cached parameter lists])."""

import torch
from torch import nn

from deepspeed.runtime.zero.partition_parameters import register_external_parameter, unregister_external_parameter
from deepspeed.utils import set_z3_leaf_modules

from deepspeed_zero3.runtime.zero.module_params import fetch_params, params_signature
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.trace import PassTrace
from zero_fakes import zmodule, zparam


def converted(module, first_id):
    module.ds_id = first_id
    for index, param in enumerate(module.parameters()):
        param.ds_id = first_id + 1 + index
        param.ds_numel = param.numel()
    return module


def test_a_replayed_step_reuses_the_recorded_list():
    a, b = converted(nn.Linear(2, 2), 0), converted(nn.Linear(2, 2), 10)
    trace = PassTrace(PassKind.FORWARD, [a, b, a])
    assert trace.params_at(0, a) is trace.step_params[0]
    assert list(trace.params_at(2, a)) == fetch_params(a)
    assert trace.params_at(1, a) is None  # another module runs step 1
    assert trace.params_at(3, a) is None and trace.params_at(-1, a) is None


def test_a_replaced_parameter_is_not_read_from_the_trace():
    a = converted(nn.Linear(2, 2), 0)
    trace = PassTrace(PassKind.FORWARD, [a])
    a.bias = nn.Parameter(torch.zeros(2))  # assigned after initialize: fetch_params must see it (and raise)
    assert trace.params_at(0, a) is None


def test_external_parameters_found_later_are_not_missed():
    a, b = converted(nn.Linear(2, 2), 0), converted(nn.Linear(2, 2), 10)
    trace = PassTrace(PassKind.FORWARD, [a, b])
    register_external_parameter(a, b.weight)
    assert trace.params_at(0, a) is None
    recorded = PassTrace(PassKind.FORWARD, [a, b])
    assert recorded.params_at(0, a) == (a.weight, a.bias, b.weight)
    unregister_external_parameter(a, b.weight)
    assert recorded.params_at(0, a) is None


def test_z3_leaves_and_custom_external_lists_always_use_fetch_params():
    leaf = converted(nn.Sequential(nn.Linear(2, 2)), 0)
    set_z3_leaf_modules(leaf, [nn.Sequential])
    assert params_signature(leaf) is None
    assert PassTrace(PassKind.FORWARD, [leaf]).params_at(0, leaf) is None

    fake = zmodule(5, zparam(1, 3), external=[zparam(2, 4)])  # ds_external_parameters without _external_params
    assert params_signature(fake) is None
    plain = zmodule(6, zparam(3, 3))
    assert PassTrace(PassKind.FORWARD, [plain]).params_at(0, plain) == tuple(fetch_params(plain))
