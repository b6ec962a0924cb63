"""The supported torch range is declared once in setup.py and once in ditorch_ext/torch_compat.py,
and both say the same; versions outside it are refused (older) or warned about (newer)."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from ditorch_ext import torch_compat

ROOT = Path(__file__).resolve().parents[2]


def _setup_torch_requirement() -> str:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            reqs = [elt.value for elt in node.value.elts]
            return next(r for r in reqs if r.startswith("torch"))
    raise AssertionError("setup.py has no install_requires")


def test_setup_py_declares_the_range_torch_compat_checks():
    assert _setup_torch_requirement() == torch_compat.requirement() == "torch>=2.11,<2.16"


def test_this_torch_is_in_the_range():
    assert torch_compat.OLDEST <= torch_compat.release()[:2] <= torch_compat.NEWEST, torch.__version__


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.15.0+cu132"])
def test_releases_in_the_range_pass_quietly(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_compat.check_supported(version)


def test_an_older_torch_is_refused_naming_both():
    with pytest.raises(RuntimeError, match=r"needs torch 2\.11 to 2\.15; this is torch 2\.10\.1"):
        torch_compat.check_supported("2.10.1")


def test_a_newer_torch_warns():
    with pytest.warns(RuntimeWarning, match=r"torch 2\.16\.0 is newer and untested"):
        torch_compat.check_supported("2.16.0")


def test_a_version_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="'nightly'"):
        torch_compat.release("nightly")
