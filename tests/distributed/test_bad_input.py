"""Bad ZeRO-3 settings fail at initialize with the key, the value and what is allowed."""

import json
import re

import pytest

from deepspeed_zero3.testing.engines import inference_engine, training_engine, zero3_config
from deepspeed_zero3.testing.models import tiny_mlp


def config_with(key, value):
    config = zero3_config()
    config["zero_optimization"][key] = value
    return config


@pytest.mark.parametrize("key", ["stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                                 "stage3_max_reuse_distance"])
def test_absurd_values_are_named(key):
    """Upstream's config accepts 10**16; a numel that large is a unit mistake (bytes, or 1e30)."""
    with pytest.raises(ValueError, match=rf"zero_optimization.{key}=10000000000000000 is not allowed: it is above "
                       r"1e\+15 parameters; the value counts parameters \(numel\), not bytes"):
        training_engine(tiny_mlp(), config_with(key, 10**16))
    with pytest.raises(ValueError, match=rf"zero_optimization.{key}=10000000000000000 is not allowed"):
        inference_engine(tiny_mlp(), config_with(key, 10**16))


@pytest.mark.parametrize("value, message", [
    (-1, "Input should be greater than or equal to 0"),
    (1.5, "Input should be a valid integer, got a number with a fractional part"),
])
def test_negative_and_fractional_values_rejected_by_upstream_config(value, message):
    """Upstream's pydantic config already names key and value for these; we keep its message."""
    with pytest.raises(Exception, match=message) as info:
        training_engine(tiny_mlp(), config_with("stage3_prefetch_bucket_size", value))
    assert "stage3_prefetch_bucket_size" in str(info.value)


def test_unknown_stage3_key_rejected():
    with pytest.raises(Exception, match="Extra inputs are not permitted") as info:
        training_engine(tiny_mlp(), config_with("stage3_prefetch_bukcet_size", 5))
    assert "stage3_prefetch_bukcet_size" in str(info.value)



@pytest.mark.parametrize("key", ["stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                                 "stage3_max_reuse_distance", "stage3_module_granularity_threshold"])
@pytest.mark.parametrize("value", [True, False])
def test_booleans_in_the_users_config_are_refused(key, value):
    """[Note: booleans in the raw config]: upstream's config would have made ``true`` a bucket of 1."""
    with pytest.raises(ValueError, match=rf"^zero_optimization.{key}={value} is not allowed: expected a number of "
                       r"parameters \(an integer from 0 to 1e\+15\), not a boolean$"):
        training_engine(tiny_mlp(), config_with(key, value))


def test_booleans_are_refused_from_a_config_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config_with("stage3_max_reuse_distance", True)))
    with pytest.raises(ValueError, match=r"zero_optimization.stage3_max_reuse_distance=True is not allowed"):
        inference_engine(tiny_mlp(), str(path))


@pytest.mark.parametrize("name, value, allowed", [
    ("DEEPSPEED_ZERO3", "maybe", "use 1 (or unset) for deepspeed-zero3's runtime, or 0"),
    ("DEEPSPEED_ZERO3_STATS_EVERY", "often", "expected a whole number of backward passes >= 0"),
    ("DEEPSPEED_ZERO3_CHECK_RANKS", "2", "use 1 to check the module order"),
])
def test_a_bad_environment_value_fails_initialize(monkeypatch, name, value, allowed):
    """One policy for the three variables: a ValueError at initialize naming the variable, the value and what is
    allowed."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}='{value}' is not allowed: {re.escape(allowed)}"):
        training_engine(tiny_mlp(), zero3_config())
