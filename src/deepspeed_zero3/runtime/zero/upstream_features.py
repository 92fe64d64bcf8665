"""Upstream features that some supported deepspeed releases have and this runtime does not cover.

[Note: features, not version numbers]
The supported releases (``_compat.SUPPORTED_DEEPSPEED_VERSIONS``) call the same surface on our two modules,
but a few of them still carry features that later ones removed. Each check here looks at the feature itself
(the class being built, the parameters' attributes), never at ``deepspeed.__version__``: a backport or a
removal in a future release then needs no change here, and the error names what the user actually asked for.
"""

from deepspeed_zero3._compat import KILL_SWITCH_ENV

# Upstream's MiCS lives in these modules (deepspeed.runtime.zero.mics and .mics_utils, up to 0.19.6).
_MICS_MODULE_PREFIX = "deepspeed.runtime.zero.mics"


def _installed_deepspeed():
    from deepspeed_zero3.activation import installed_deepspeed_version
    return installed_deepspeed_version() or "unknown"


def _from_mics(cls) -> bool:
    return any(getattr(klass, "__module__", "").startswith(_MICS_MODULE_PREFIX) for klass in cls.__mro__)


def uses_mics(offload, module) -> bool:
    """True when MiCS drives this engine: upstream's MiCS_Offload subclass is being built (what
    ``zero_optimization.mics_shard_size > 0`` selects), or the parameters were partitioned by ``MiCS_Init``
    (they carry MiCS's communication groups as ``param.comm``)."""
    if _from_mics(type(offload)):
        return True
    return any(_from_mics(type(getattr(param, "comm", None))) for param in module.parameters())


def mics_not_covered() -> NotImplementedError:
    return NotImplementedError(
        f"MiCS (zero_optimization.mics_shard_size > 0, or parameters built by deepspeed.zero.MiCS_Init) is not "
        f"covered by deepspeed-zero3: the installed deepspeed {_installed_deepspeed()} still provides it (upstream "
        f"removed it in 0.19.7), but this runtime has no parity tests for MiCS's sharding. Set "
        f"{KILL_SWITCH_ENV}=0 to run upstream's ZeRO-3 runtime for this job, or drop mics_shard_size / MiCS_Init.")


def refuse_uncovered_features(offload, module) -> None:
    """Raise before anything is converted or hooked when ``offload`` would need a feature we do not cover."""
    if uses_mics(offload, module):
        raise mics_not_covered()
