"""Serve our ZeRO-3 modules under upstream's names.

A ``.pth`` file installed next to this package calls :func:`install` at
interpreter start. :func:`install` only appends a finder to ``sys.meta_path``:
it imports neither torch nor deepspeed, so start-up stays cheap. The finder
acts only when something imports one of the two overlaid module names; it
then imports our implementation and hands that very module object back under
the upstream name, so ``deepspeed.runtime.zero.parameter_offload is
deepspeed_zero3.runtime.zero.parameter_offload``.

The overlay stands aside (upstream runs untouched) when:

* ``DEEPSPEED_ZERO3=0`` (the kill switch), or
* the installed ``deepspeed`` is not a supported version (one warning, naming
  both versions).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

from deepspeed_zero3._compat import KILL_SWITCH_ENV, OVERLAID_MODULES, SUPPORTED_DEEPSPEED_VERSIONS, describe_supported

_OFF_VALUES = {"0", "false", "off", "no"}
_ON_VALUES = {"", "1", "true", "on", "yes"}

_warned = set()


def _warn_once(key, message):
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def kill_switch_state():
    """Return (enabled, reason) from the ``DEEPSPEED_ZERO3`` environment variable."""
    raw = os.environ.get(KILL_SWITCH_ENV)
    if raw is None:
        return True, f"{KILL_SWITCH_ENV} is unset"
    value = raw.strip().lower()
    if value in _OFF_VALUES:
        return False, f"{KILL_SWITCH_ENV}={raw} (kill switch)"
    if value not in _ON_VALUES:
        # The overlay stays on so that initialize (check_kill_switch) refuses the value: an import cannot.
        return True, f"{KILL_SWITCH_ENV}={raw!r} is not understood"
    return True, f"{KILL_SWITCH_ENV}={raw}"


def check_kill_switch(environ) -> None:
    """Raise ValueError for a ``DEEPSPEED_ZERO3`` value that is neither on nor off; called at initialize, where
    every environment variable of ours is checked (one policy: a clear error there, never a guess)."""
    raw = environ.get(KILL_SWITCH_ENV)
    if raw is not None and raw.strip().lower() not in _OFF_VALUES | _ON_VALUES:
        raise ValueError(f"{KILL_SWITCH_ENV}={raw!r} is not allowed: use 1 (or unset) for deepspeed-zero3's "
                         f"runtime, or 0 for upstream's runtime untouched")


def installed_deepspeed_version():
    """Version of the installed ``deepspeed`` distribution, read from its metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


def overlay_decision():
    """Return (active, reason). Rank-independent: it reads only the environment and metadata."""
    enabled, reason = kill_switch_state()
    if not enabled:
        return False, reason
    found = installed_deepspeed_version()
    if found is None:
        return False, "deepspeed is not installed"
    # Membership, not a range: a release inside the span that was never run through test-versions is off too.
    if found not in SUPPORTED_DEEPSPEED_VERSIONS:
        supported = describe_supported()
        _warn_once(("version", found),
                   f"deepspeed-zero3 supports deepspeed {supported}, but deepspeed {found} is installed; "
                   f"the overlay is off and upstream's ZeRO-3 runtime runs unmodified. Install a supported "
                   f"release to use it.")
        return False, f"deepspeed {found} is not a supported version ({supported})"
    return True, f"deepspeed {found} is supported"


class _AliasLoader(importlib.abc.Loader):
    """Loads an upstream module name as our already-imported implementation module."""

    def __init__(self, impl_name):
        self.impl_name = impl_name

    def create_module(self, spec):
        return importlib.import_module(self.impl_name)

    def exec_module(self, module):
        # Our module ran its own code when it was imported in create_module.
        pass


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder for the two overlaid module names; every other name is left alone."""

    def find_spec(self, fullname, path=None, target=None):
        impl_name = OVERLAID_MODULES.get(fullname)
        if impl_name is None:
            return None
        active, _ = overlay_decision()
        if not active:
            return None
        impl_spec = importlib.util.find_spec(impl_name)
        origin = impl_spec.origin if impl_spec is not None else None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(impl_name), origin=origin)


def _installed_finder():
    for finder in sys.meta_path:
        if isinstance(finder, OverlayFinder) or type(finder).__name__ == "OverlayFinder":
            return finder
    return None


def install():
    """Put the finder in front of the path finders. Idempotent; called by the ``.pth`` file."""
    if _installed_finder() is None:
        sys.meta_path.insert(0, OverlayFinder())


def overlay_status():
    """A dict describing whether the overlay is active and where each overlaid name resolves."""
    active, reason = overlay_decision()
    modules = {}
    for upstream_name in OVERLAID_MODULES:
        loaded = sys.modules.get(upstream_name)
        if loaded is not None:
            modules[upstream_name] = getattr(loaded, "__file__", None)
            continue
        try:
            spec = importlib.util.find_spec(upstream_name)
        except Exception as exc:  # deepspeed missing or broken
            modules[upstream_name] = f"<not importable: {exc}>"
            continue
        modules[upstream_name] = spec.origin if spec is not None else None
    return {
        "active": active and _installed_finder() is not None,
        "reason": reason if _installed_finder() is not None else "the activation hook is not installed "
        "(is deepspeed_zero3_activate.pth in site-packages? `pip install -e .` does not ship it)",
        "deepspeed_version": installed_deepspeed_version(),
        "supported_versions": list(SUPPORTED_DEEPSPEED_VERSIONS),
        "modules": modules,
    }
