"""Counting the collectives a block of code issues, at the call deepspeed's backend makes."""

import contextlib

import deepspeed
import deepspeed.comm.comm  # noqa: F401  (the backend object is read from it)


@contextlib.contextmanager
def parameter_gathers():
    """Counts the all-gathers that carry parameter shards: calls of the torch.distributed function deepspeed's
    backend gathers into a flat tensor with (``all_gather_into_tensor``, bound when deepspeed initialized)."""
    backend = deepspeed.comm.comm.cdb
    original = backend.all_gather_function
    counted = {"calls": 0}

    def wrapped(*args, **kwargs):
        counted["calls"] += 1
        return original(*args, **kwargs)

    backend.all_gather_function = wrapped
    try:
        yield counted
    finally:
        backend.all_gather_function = original
