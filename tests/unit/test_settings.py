"""Validation of the stage3_* numel knobs: every rejection names the config key, the value and what is allowed."""

import dataclasses

import pytest

from deepspeed_zero3.runtime.zero.settings import ABSURD_NUMEL, PrefetchSettings, validate_numel

KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance")


def test_absurd_numel_is_1e15():
    assert ABSURD_NUMEL == 10**15
    assert f"{ABSURD_NUMEL:.0e}" == "1e+15"


@pytest.mark.parametrize("value, expected", [
    (0, 0),
    (1, 1),
    (50_000_000, 50_000_000),
    (10**15, 10**15),  # the bound itself is allowed
    (1e6, 1_000_000),
    (5e7, 50_000_000),
    (0.0, 0),
    (1e15, 10**15),
])
def test_valid_values_pass_as_ints(value, expected):
    result = validate_numel("stage3_prefetch_bucket_size", value)
    assert result == expected
    assert type(result) is int


def test_int_subclass_passes_unchanged():
    class ConfigInt(int):  # like deepspeed's pp_int, which its config defaults use
        pass

    value = ConfigInt(1000)
    assert validate_numel("stage3_max_live_parameters", value) is value


@pytest.mark.parametrize("value, message", [
    (-1, "zero_optimization.{key}=-1 is not allowed: expected an integer from 0 to 1e+15"),
    (-(10**20), "zero_optimization.{key}=-100000000000000000000 is not allowed: expected an integer from 0 to 1e+15"),
    (1.5, "zero_optimization.{key}=1.5 is not allowed: expected a whole number of parameters "
     "(an integer from 0 to 1e+15)"),
    (float("inf"), "zero_optimization.{key}=inf is not allowed: expected a whole number of parameters "
     "(an integer from 0 to 1e+15)"),
    (float("nan"), "zero_optimization.{key}=nan is not allowed: expected a whole number of parameters "
     "(an integer from 0 to 1e+15)"),
    (True, "zero_optimization.{key}=True is not allowed: expected a number of parameters "
     "(an integer from 0 to 1e+15), not a boolean"),
    (False, "zero_optimization.{key}=False is not allowed: expected a number of parameters "
     "(an integer from 0 to 1e+15), not a boolean"),
    ("5e7", "zero_optimization.{key}='5e7' is not allowed: expected an integer number of parameters "
     "from 0 to 1e+15"),
    ("100", "zero_optimization.{key}='100' is not allowed: expected an integer number of parameters "
     "from 0 to 1e+15"),
    (None, "zero_optimization.{key}=None is not allowed: expected an integer number of parameters from 0 to 1e+15"),
    (10**15 + 1, "zero_optimization.{key}=1000000000000001 is not allowed: it is above 1e+15 parameters; "
     "the value counts parameters (numel), not bytes"),
])
@pytest.mark.parametrize("key", KEYS)
def test_invalid_values_name_key_value_and_range(key, value, message):
    with pytest.raises(ValueError) as info:
        validate_numel(key, value)
    assert str(info.value) == message.format(key=key)


@pytest.mark.parametrize("value, fragment", [
    (-2.0, "is not allowed: expected an integer from 0 to 1e+15"),
    (1e30, "is not allowed: it is above 1e+15 parameters; the value counts parameters (numel), not bytes"),
])
def test_integral_floats_out_of_range_are_rejected(value, fragment):
    # Only key and range are pinned here: the value is shown after int() conversion
    # ("=-2" for -2.0, "=1000000000000000019884624838656" for 1e30), not as written.
    with pytest.raises(ValueError) as info:
        validate_numel("stage3_max_reuse_distance", value)
    assert str(info.value).startswith("zero_optimization.stage3_max_reuse_distance=")
    assert fragment in str(info.value)


def test_zero_rejected_when_not_allowed():
    with pytest.raises(ValueError) as info:
        validate_numel("stage3_prefetch_bucket_size", 0, allow_zero=False)
    assert str(info.value) == "zero_optimization.stage3_prefetch_bucket_size=0 is not allowed: expected an integer " \
                              "from 1 to 1e+15"
    assert validate_numel("stage3_prefetch_bucket_size", 1, allow_zero=False) == 1


def test_from_config_values_maps_each_value_to_its_field():
    settings = PrefetchSettings.from_config_values(1e6, 2_000_000, 3.0)
    assert settings == PrefetchSettings(bucket_numel=1_000_000, max_live_numel=2_000_000, max_reuse_numel=3)
    assert [type(v) for v in dataclasses.astuple(settings)] == [int, int, int]


def test_from_config_values_accepts_upstream_defaults():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = DeepSpeedZeroConfig(stage=3)
    settings = PrefetchSettings.from_config_values(config.prefetch_bucket_size, config.max_live_parameters,
                                                   config.max_reuse_distance)
    assert settings == PrefetchSettings(bucket_numel=50_000_000, max_live_numel=1_000_000_000,
                                        max_reuse_numel=1_000_000_000)


@pytest.mark.parametrize("position, key", list(enumerate(KEYS)))
def test_from_config_values_error_names_the_offending_key(position, key):
    values = [100, 200, 300]
    values[position] = -5
    with pytest.raises(ValueError) as info:
        PrefetchSettings.from_config_values(*values)
    assert str(info.value) == f"zero_optimization.{key}=-5 is not allowed: expected an integer from 0 to 1e+15"


def test_settings_are_frozen():
    settings = PrefetchSettings.from_config_values(1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.bucket_numel = 5
