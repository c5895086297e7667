"""The code's boundaries, checked: import layers (import-linter contracts in pyproject.toml), lint
(ruff) and types (mypy), each as configured in pyproject.toml."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("tool", [["lint-imports"], ["ruff", "check", "."], ["mypy"]], ids=lambda t: t[0])
def test_static_check_passes(tool):
    result = subprocess.run([str(BIN / tool[0]), *tool[1:]], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_an_import_up_a_layer_is_caught(tmp_path):
    """The contracts are not vacuous: a controller module importing the Serve layer breaks them."""
    copy = tmp_path / "repo"
    for package in ("controller", "kernels", "workers", "deployments", "loadtest", "monitoring"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    (copy / "controller" / "laws" / "leak.py").write_text("import deployments.config\n")
    result = subprocess.run([str(BIN / "lint-imports")], cwd=copy, capture_output=True, text=True,
                            env={"PATH": str(BIN), "PYTHONPATH": str(copy)})
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-3000:]
