"""Bad ZeRO-3 settings fail at initialize with the key, the value and what is allowed."""

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

