"""setup.py exists for one job: ship the activation .pth into site-packages.

Everything else lives in pyproject.toml.
"""

import ast
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "deepspeed_zero3_activate.pth"


class BuildPyWithPth(build_py):
    """Copy the .pth file to the root of the built tree, so the wheel installs it into site-packages."""

    def run(self):
        super().run()
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", PTH_NAME)
        self.copy_file(source, os.path.join(self.build_lib, PTH_NAME), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


def compat_versions(name):
    """The version tuple ``name`` of src/deepspeed_zero3/_compat.py (read, not imported), oldest first."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "deepspeed_zero3", "_compat.py")
    with open(path) as handle:
        tree = ast.parse(handle.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return sorted(ast.literal_eval(node.value), key=lambda v: tuple(int(x) for x in v.split(".")))
    raise RuntimeError(f"{name} not found in src/deepspeed_zero3/_compat.py")


def supported_deepspeed_requirement():
    """The deepspeed requirement, from SUPPORTED_DEEPSPEED_VERSIONS.

    One version pins it exactly; several give the range they span, and the run-time check in
    deepspeed_zero3.activation turns the overlay off for any version in between that is not listed.
    """
    versions = compat_versions("SUPPORTED_DEEPSPEED_VERSIONS")
    if len(versions) == 1:
        return f"deepspeed=={versions[0]}"
    return f"deepspeed>={versions[0]},<={versions[-1]}"


def measured_torch_requirement():
    """The torch requirement, from MEASURED_TORCH_VERSIONS: the first measured minor series up to the one after
    the last (the matrix runs each series at one patch release; the others of a series are taken as alike)."""
    versions = compat_versions("MEASURED_TORCH_VERSIONS")
    first, last = versions[0].split("."), versions[-1].split(".")
    return f"torch>={first[0]}.{first[1]},<{last[0]}.{int(last[1]) + 1}"


setup(cmdclass={"build_py": BuildPyWithPth},
      install_requires=[supported_deepspeed_requirement(), measured_torch_requirement(), "packaging"])
