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


def supported_deepspeed_requirement():
    """Build the deepspeed requirement from SUPPORTED_DEEPSPEED_VERSIONS in _compat.py (read, not imported).

    One version pins it exactly; several give the range they span, and the run-time check in
    deepspeed_zero3.activation turns the overlay off for any version in between that is not listed.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "deepspeed_zero3", "_compat.py")
    with open(path) as handle:
        tree = ast.parse(handle.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SUPPORTED_DEEPSPEED_VERSIONS":
            versions = sorted(ast.literal_eval(node.value), key=lambda v: tuple(int(x) for x in v.split(".")))
            if len(versions) == 1:
                return f"deepspeed=={versions[0]}"
            return f"deepspeed>={versions[0]},<={versions[-1]}"
    raise RuntimeError("SUPPORTED_DEEPSPEED_VERSIONS not found in src/deepspeed_zero3/_compat.py")

setup(cmdclass={"build_py": BuildPyWithPth}, install_requires=[supported_deepspeed_requirement(), "torch", "packaging"])
