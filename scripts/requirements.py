"""Print pyproject's dependencies plus the named extras, one per line, for `pip install -r -`.

The project itself is not installed into the environment: the Makefile puts the checkout
on PYTHONPATH, so a shared environment never runs a stale copy of the code.
"""
import sys
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
lines = list(project["dependencies"])
for extra in sys.argv[1:]:
    lines += project["optional-dependencies"][extra]
print("\n".join(lines))
