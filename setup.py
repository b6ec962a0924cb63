"""Build ditorch: CMake + ninja drive the C++ extensions, setuptools only places them.

Install with ``pip install --no-build-isolation -e .`` against the torch already installed (any
release from 2.11 to 2.15; an isolated build environment would resolve and download another torch).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """A Python module that CMake builds as ``target`` into ``ROOT/<package>/``."""

    def __init__(self, name: str, target: str):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def run(self):
        import torch  # the build links against the installed torch

        # The venv's cmake/ninja (from requirements.txt) when the system has none.
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        build_dir = ROOT / "build" / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / "build.ninja").exists():
            subprocess.check_call(
                [
                    "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython3_EXECUTABLE={sys.executable}",
                    f"-DTORCH_ROOT={os.path.dirname(torch.__file__)}",
                ],
                env=env,
            )
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        targets = [ext.target for ext in self.extensions]
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs, "--target", *targets], env=env)
        for ext in self.extensions:
            built = ROOT / Path(*ext.name.split(".")).parent / Path(self.get_ext_filename(ext.name)).name
            dest = Path(self.get_ext_fullpath(ext.name)).resolve()
            if built.resolve() != dest:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(built, dest)


setup(
    name="ditorch",
    version="0.1.0",
    description="Train one model on a hyper-heterogeneous fleet of accelerators with PyTorch",
    python_requires=">=3.10",
    packages=find_packages(include=["ditorch*", "ditorch_ext*", "dicomm*", "heteropp*", "dips*", "volunteer*",
                                    "dimodel*", "diutil*"]),
    ext_modules=[
        CMakeExtension("ditorch_ext._C", target="ditorch_device"),
        CMakeExtension("dicomm._C", target="dicomm_backend"),
    ],
    cmdclass={"build_ext": CMakeBuild},
    # The torch releases built and tested at both ends by `make test-torch` (docs/device.md,
    # "Supported torch versions"; ditorch_ext/torch_compat.py names the same range). `make setup`
    # installs 2.13.0 (requirements.txt) inside it.
    install_requires=["torch>=2.11,<2.16", "numpy", "pyyaml"],
    extras_require={"hf": ["transformers==5.24.0"]},
    entry_points={"console_scripts": ["ditorch = ditorch.cli:main"]},
    zip_safe=False,
)
