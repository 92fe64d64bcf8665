"""The ZeRO-3 knobs the coordinator honours, validated with errors that name the config key.

[Note: booleans in the raw config]
Upstream's config turns ``true`` into 1 and ``false`` into 0 before any value reaches us, so a
``stage3_prefetch_bucket_size: true`` would silently become a bucket of 1. The user's own values are
read first, before the config's (``reject_boolean_numels``), and a boolean among the four numel keys is
refused naming the key. Negative and fractional values never get this far: upstream's config refuses
them, with its own message naming the key.
"""

import base64
import json
import os
from dataclasses import dataclass

# Larger than any model anyone trains, small enough to catch a unit mistake (bytes, or 1e30).
ABSURD_NUMEL = 10**15


def validate_numel(key: str, value, allow_zero: bool = True) -> int:
    """Return ``value`` as an int numel, or raise ValueError naming ``key``, the value and what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"zero_optimization.{key}={value!r} is not allowed: expected a number of "
                         f"parameters (an integer from 0 to {ABSURD_NUMEL:.0e}), not a boolean")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"zero_optimization.{key}={value!r} is not allowed: expected a whole number of "
                             f"parameters (an integer from 0 to {ABSURD_NUMEL:.0e})")
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"zero_optimization.{key}={value!r} is not allowed: expected an integer number of "
                         f"parameters from 0 to {ABSURD_NUMEL:.0e}")
    if value < 0 or (value == 0 and not allow_zero):
        lowest = 0 if allow_zero else 1
        raise ValueError(f"zero_optimization.{key}={value} is not allowed: expected an integer from {lowest} "
                         f"to {ABSURD_NUMEL:.0e}")
    if value > ABSURD_NUMEL:
        raise ValueError(f"zero_optimization.{key}={value} is not allowed: it is above {ABSURD_NUMEL:.0e} "
                         f"parameters; the value counts parameters (numel), not bytes")
    return value


# The four numel keys as a user writes them (upstream's config refuses their bare field names).
NUMEL_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
              "stage3_module_granularity_threshold")


def raw_zero_section(ds_config) -> dict:
    """The user's own ``zero_optimization`` values: ``ds_config`` is what ``deepspeed.initialize`` was given (a
    dict, a JSON file's path or base64-encoded JSON); {} for anything else."""
    config = ds_config
    if isinstance(config, str):
        try:
            if os.path.exists(config):
                with open(config) as handle:
                    config = json.load(handle)
            else:
                config = json.loads(base64.urlsafe_b64decode(config).decode())
        except (OSError, ValueError):
            return {}
    section = config.get("zero_optimization") if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


def reject_boolean_numels(ds_config) -> None:
    """Refuse a boolean among the four numel keys of the user's own config ([Note: booleans in the raw
    config])."""
    section = raw_zero_section(ds_config)
    for key in NUMEL_KEYS:
        if isinstance(section.get(key), bool):
            validate_numel(key, section[key])


@dataclass(frozen=True)
class PrefetchSettings:
    """How far ahead to gather and how much to keep, in numel (upstream's ``stage3_*`` meanings).

    bucket_numel: ``stage3_prefetch_bucket_size``; the prefetch window. 0 turns prefetching off.
    max_live_numel: ``stage3_max_live_parameters``; cap on gathered numel beyond the module in use.
    max_reuse_numel: ``stage3_max_reuse_distance``; a released parameter whose next use comes within
        this many numel of fetches stays gathered. 0 releases every parameter after each use in a pass;
        a forward still keeps what its backward's first window would gather again ([Note: budgeted keeping]).
    """
    bucket_numel: int
    max_live_numel: int
    max_reuse_numel: int

    @classmethod
    def from_config_values(cls, prefetch_bucket_size, max_live_parameters, max_reuse_distance) -> "PrefetchSettings":
        return cls(
            bucket_numel=validate_numel("stage3_prefetch_bucket_size", prefetch_bucket_size),
            max_live_numel=validate_numel("stage3_max_live_parameters", max_live_parameters),
            max_reuse_numel=validate_numel("stage3_max_reuse_distance", max_reuse_distance),
        )
