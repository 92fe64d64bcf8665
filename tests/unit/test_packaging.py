"""Packaging: one source for the version, the license files, and the type marker."""

import re
import subprocess
import sys
from pathlib import Path

import deepspeed_zero3

REPO = Path(__file__).resolve().parents[2]


def test_the_version_has_one_source():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^version\s*=\s*"', pyproject, flags=re.M) is None  # no literal version in [project]
    assert 'version = {attr = "deepspeed_zero3.__version__"}' in pyproject
    source = (REPO / "src" / "deepspeed_zero3" / "__init__.py").read_text()
    assert f'__version__ = "{deepspeed_zero3.__version__}"' in source


def test_license_notice_changelog_and_type_marker_ship():
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "DeepSpeed" in (REPO / "NOTICE").read_text()
    assert "## Version policy" in (REPO / "CHANGELOG.md").read_text()
    assert (Path(deepspeed_zero3.__file__).parent / "py.typed").exists()  # in the installed package


def test_python_requirement_is_torchs():
    assert 'requires-python = ">=3.10"' in (REPO / "pyproject.toml").read_text()


def test_every_public_name_resolves_lazily():
    """``deepspeed_zero3.__all__`` is the public surface (the stream's types included, for annotations); each name
    resolves, and importing the package alone pulls in neither torch nor deepspeed (checked in a fresh process)."""
    import deepspeed_zero3
    from deepspeed_zero3.runtime.zero.weight_stream import StreamStats, TensorMeta, WeightStream

    assert {"WeightStream", "TensorMeta", "StreamStats", "iter_gathered_parameters"} <= set(deepspeed_zero3.__all__)
    assert (deepspeed_zero3.WeightStream, deepspeed_zero3.TensorMeta, deepspeed_zero3.StreamStats) == (
        WeightStream, TensorMeta, StreamStats)
    for name in deepspeed_zero3.__all__:
        assert getattr(deepspeed_zero3, name) is not None, name
    probe = ("import sys, deepspeed_zero3; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
