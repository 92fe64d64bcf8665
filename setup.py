"""setup.py exists for one job: ship the activation .pth into site-packages.

Everything else lives in pyproject.toml.
"""

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


setup(cmdclass={"build_py": BuildPyWithPth})
