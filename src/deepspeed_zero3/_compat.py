"""The one place that says which upstream DeepSpeed releases this overlay supports.

Kept free of torch and deepspeed imports: the activation hook reads it at
interpreter start.
"""

# Each release listed here is measured by the version matrix (`make test-versions`, scripts/matrix.py):
# docs/compat/versions.md has its row, with the commit it ran on and the outcome of each suite. setup.py
# derives the pip requirement (the span from first to last) from it, the activation hook checks membership,
# and the Makefile reads it for DEEPSPEED_VERSION (one line: the Makefile and scripts/versions_table.py read it
# as text). How a new release gets added: docs/maintaining.md. Every release from 0.16.0 on has the single
# coordinator our runtime replaces; what differs between them is detected as a feature (capabilities.py).
SUPPORTED_DEEPSPEED_VERSIONS = ("0.16.0", "0.16.1", "0.16.2", "0.16.3", "0.16.4", "0.16.5", "0.16.6", "0.16.7", "0.16.8", "0.16.9", "0.17.0", "0.17.1", "0.17.2", "0.17.3", "0.17.4", "0.17.5", "0.17.6", "0.18.0", "0.18.1", "0.18.2", "0.18.3", "0.18.4", "0.18.5", "0.18.6", "0.18.7", "0.18.8", "0.18.9", "0.19.0", "0.19.1", "0.19.2", "0.19.3", "0.19.4", "0.19.5", "0.19.6", "0.19.7", "0.19.8")

# Each torch release listed here is measured by the same matrix with the newest supported deepspeed
# (docs/compat/versions.md's torch table; the Makefile's TORCH_VERSIONS is this list). setup.py requires torch from
# the first minor series to the last.
MEASURED_TORCH_VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")

# The upstream modules we serve our own implementation for, mapped to ours.
OVERLAID_MODULES = {
    "deepspeed.runtime.zero.partitioned_param_coordinator": "deepspeed_zero3.runtime.zero.partitioned_param_coordinator",
    "deepspeed.runtime.zero.parameter_offload": "deepspeed_zero3.runtime.zero.parameter_offload",
}

KILL_SWITCH_ENV = "DEEPSPEED_ZERO3"


def describe_supported(versions=SUPPORTED_DEEPSPEED_VERSIONS) -> str:
    """For messages: each minor series as ``0.16.0-0.16.9`` where its listed patch releases are consecutive
    (from .0), else as a list; ``0.16.0-0.19.8`` when every series is complete that way."""
    series = {}
    for version in versions:
        major, minor, patch = (int(part) for part in version.split("."))
        series.setdefault((major, minor), []).append(patch)
    parts, whole = [], True
    for (major, minor), patches in series.items():
        run = len(patches) > 2 and patches == list(range(patches[0], patches[0] + len(patches)))
        whole = whole and run and patches[0] == 0
        if run:
            parts.append(f"{major}.{minor}.{patches[0]}-{major}.{minor}.{patches[-1]}")
        else:
            parts.extend(f"{major}.{minor}.{patch}" for patch in patches)
    if whole and len(series) > 1:
        return f"{versions[0]}-{versions[-1]}"
    return ", ".join(parts)
