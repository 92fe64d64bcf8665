"""Labelled ``torch.profiler`` ranges around fetch, prefetch issue, wait and release.

[Note: profiler ranges]
Under a running ``torch.profiler.profile`` (or the legacy autograd profiler, ``emit_nvtx``, ...) every
fetch, prefetch issue, wait and release of a module shows as a ``record_function`` range named
``ZeRO3::<what> <module class> ds_id=<id>``, as FSDP2 labels its all-gathers, so a Chrome trace of a step
shows which module's parameters the host was busy with and where it waited. With no profiler running
the range is one shared ``nullcontext``: the label string is never built and nothing is recorded; the
only cost is one C call (``torch._C._autograd._profiler_enabled``, ~40 ns) per range. These run inside
the compile-disabled hooks: nothing here is meant to be traced by Dynamo.
"""

import contextlib

import torch

_NO_RANGE = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled


def module_range(what: str, module, suffix: str = "", params=None):
    """A profiler range ``ZeRO3::<what> <class> ds_id=<id><suffix>`` while a profiler runs, else a no-op.

    ``suffix`` is a constant (nothing is formatted when no profiler runs); ``params``, when given, adds
    their count and numel to the label.
    """
    if not _profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(f"ZeRO3::{what} {type(module).__name__} ds_id={module.ds_id}{suffix}"
                                          f"{_sizes(params)}")


def pass_range(what: str, suffix: str = "", params=None):
    """A range that names no module (the prefetch that primes a backward pass)."""
    if not _profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(f"ZeRO3::{what}{suffix}{_sizes(params)}")


def _sizes(params) -> str:
    if params is None:
        return ""
    return f" ({len(params)} params, {sum(p.ds_numel for p in params)} numel)"
