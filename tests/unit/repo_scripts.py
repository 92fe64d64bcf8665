"""The repository's scripts and tools, loaded from their files for their unit tests (they are not a package)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load(relative: str):
    """The module at ``REPO/relative``; its folder goes on sys.path first, for the siblings it imports."""
    path = REPO / relative
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
