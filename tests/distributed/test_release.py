"""[Note: releasing a gathered parameter]: ``release`` leaves a parameter exactly as upstream's ``param.partition()``
does, takes the direct path only where that is upstream's branch, and calls a replaced ``param.partition``."""

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero import release as release_module


def state(param):
    return (param.ds_status, tuple(param.data.shape), param.data.dtype, param.data.device, id(param.ds_tensor),
            param.ds_tensor.data_ptr(), id(param.ds_secondary_tensor))


def twin_params(**init_kwargs):
    """Two identical partitioned Linear layers, built under zero.Init on every rank."""
    with deepspeed.zero.Init(**init_kwargs):
        torch.manual_seed(0)
        a = nn.Linear(32, 16)
        torch.manual_seed(0)
        b = nn.Linear(32, 16)
    return list(a.parameters()), list(b.parameters())


@pytest.fixture
def restore_hpz_group():
    """zero.Init with zero_hpz_partition_size makes a process-wide hpZ group that every later engine picks up
    (the engine reads it whatever its own config): an NVMe-offloaded engine in a later test would then make hpZ
    secondary partitions on the device "nvme". Put back what was there before."""
    from deepspeed.utils import groups

    before = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    yield
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = before


@pytest.mark.parametrize("hpz", [False, True])
def test_release_leaves_what_partition_leaves(hpz, restore_hpz_group):
    kwargs = {"config_dict_or_path": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "zero_hpz_partition_size": torch.distributed.get_world_size()}}} if hpz else {}
    ours, theirs = twin_params(**kwargs)
    for mine, reference in zip(ours, theirs, strict=True):
        mine.all_gather()
        reference.all_gather()
        assert mine.ds_status is ZeroParamStatus.AVAILABLE and torch.equal(mine.data, reference.data)
        assert (mine.ds_secondary_tensor is not None) == hpz
        assert release_module.takes_direct_path(mine), mine.ds_summary()
        before = state(mine)
        release_module.release(mine)
        reference.partition()
        assert state(mine)[0] is ZeroParamStatus.NOT_AVAILABLE and state(mine)[4:] == before[4:]
        assert state(mine)[:4] == state(reference)[:4]
        # The partition itself is untouched: gathering again gives the same values.
        mine.all_gather()
        reference.all_gather()
        assert torch.equal(mine.data, reference.data)
        mine.partition()
        reference.partition()


def test_a_replaced_partition_is_called():
    (weight, bias), _ = twin_params()
    calls = []
    original = weight.partition

    def counting(*args, **kwargs):
        calls.append(weight.ds_id)
        return original(*args, **kwargs)

    weight.partition = counting
    for param in (weight, bias):
        param.all_gather()
    assert not release_module.takes_direct_path(weight) and release_module.takes_direct_path(bias)
    for param in (weight, bias):
        release_module.release(param)
        assert param.ds_status is ZeroParamStatus.NOT_AVAILABLE and param.data.numel() == 0
    assert calls == [weight.ds_id]
