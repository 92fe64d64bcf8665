"""Upstream features some supported releases still have and we refuse ([Note: features, not version numbers]).

MiCS exists in deepspeed 0.19.4-0.19.6 and is gone from 0.19.7. The checks look at the feature (the class
being built, the parameters' attributes), so the same tests run against every supported release; the one
that needs upstream's real MiCS classes skips where the installed release has none.
"""

import importlib.util

import pytest
import torch

from deepspeed_zero3.activation import installed_deepspeed_version
from deepspeed_zero3.runtime.zero import upstream_features
from deepspeed_zero3.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

HAS_MICS = importlib.util.find_spec("deepspeed.runtime.zero.mics") is not None


def mics_like(name, base=object):
    """A class that claims to come from upstream's MiCS modules, as MiCS_Offload and MiCS_CommGroups do."""
    return type(name, (base, ), {"__module__": "deepspeed.runtime.zero.mics"})


def test_plain_offload_and_parameters_are_not_mics():
    module = torch.nn.Linear(3, 2)
    assert upstream_features.uses_mics(object.__new__(DeepSpeedZeRoOffload), module) is False
    upstream_features.refuse_uncovered_features(object.__new__(DeepSpeedZeRoOffload), module)  # no raise


def test_a_mics_subclass_of_our_offload_is_refused_by_name_version_and_remedy():
    offload = object.__new__(mics_like("MiCS_Offload", DeepSpeedZeRoOffload))
    with pytest.raises(NotImplementedError) as caught:
        upstream_features.refuse_uncovered_features(offload, torch.nn.Linear(3, 2))
    message = str(caught.value)
    assert "MiCS (zero_optimization.mics_shard_size > 0" in message
    assert f"installed deepspeed {installed_deepspeed_version()}" in message
    assert "Set DEEPSPEED_ZERO3=0" in message and "drop mics_shard_size" in message


def test_parameters_partitioned_by_mics_init_are_refused():
    module = torch.nn.Linear(3, 2)
    module.weight.comm = mics_like("MiCS_CommGroups")()
    assert upstream_features.uses_mics(object.__new__(DeepSpeedZeRoOffload), module) is True
    with pytest.raises(NotImplementedError, match="MiCS"):
        upstream_features.refuse_uncovered_features(object.__new__(DeepSpeedZeRoOffload), module)


@pytest.mark.skipif(not HAS_MICS, reason=f"deepspeed {installed_deepspeed_version()} has no MiCS (removed in 0.19.7)")
def test_upstreams_own_mics_offload_stops_in_our_constructor():
    """What mics_shard_size > 0 builds (MiCS_Optimizer.initialize_ds_offload) fails at once, before any
    parameter is converted or hooked (no process group is needed to see it)."""
    from deepspeed.runtime.zero.mics import MiCS_Offload
    assert issubclass(MiCS_Offload, DeepSpeedZeRoOffload)  # the overlay serves the base class
    module = torch.nn.Linear(3, 2)
    with pytest.raises(NotImplementedError, match=r"MiCS .* Set DEEPSPEED_ZERO3=0"):
        MiCS_Offload(module, None, {})
    assert not hasattr(module.weight, "ds_id")
    assert not module._forward_pre_hooks
