"""The native helpers (sandbox init, NCCL interceptor, CPU stand-in NCCL) are built into the wheel by the project's
own Makefile, for the machine the wheel is built on; everything else is in pyproject.toml."""

from __future__ import annotations

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildWithNative(build_py):
    def run(self) -> None:
        super().run()
        out = Path(self.build_lib).resolve() / "cryosleep" / "_native"
        subprocess.run(["make", "-C", str(Path(__file__).resolve().parent / "native"), f"OUT={out}"], check=True)


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # a platform wheel: it carries machine code
        return True


setup(cmdclass={"build_py": BuildWithNative}, distclass=BinaryDistribution)
