"""What a benchmark process reports about itself: which runtime served it, and which source it ran."""

import subprocess


def runtime_name() -> str:
    """``"ours"`` when deepspeed serves this package's ZeRO-3 modules, ``"upstream"`` under the kill switch (read
    from the file ``deepspeed.runtime.zero.parameter_offload`` was loaded from)."""
    import deepspeed.runtime.zero.parameter_offload as parameter_offload
    return "ours" if "deepspeed_zero3" in (getattr(parameter_offload, "__file__", "") or "") else "upstream"


def source_commit() -> str:
    """The checkout's commit a results file was measured on, ``+changes`` when the runtime's sources differ from it
    (``src/``, ``setup.py``, ``pyproject.toml``); ``"unknown"`` outside a git checkout."""
    def git(*argv):
        return subprocess.run(["git", *argv], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        if head.returncode != 0:
            return "unknown"
        changed = git("status", "--porcelain", "--", "src", "setup.py", "pyproject.toml").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed else "")
