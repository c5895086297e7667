"""The image (Dockerfile): it installs exactly what `make install` installs, on the Ray version we pin, where
the manifests in k8s/ expect it. Building and running it needs a container runtime and a registry or a local
base image; k8s/README.md says how, and what was built where."""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(line for line in DOCKERFILE.splitlines()
                                             if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def test_the_base_is_rays_image_for_the_ray_version_we_pin():
    pinned = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                  if d.startswith("ray["))
    version = pinned.split("==")[1]
    base = next(args for op, args in _instructions() if op == "ARG" and args.startswith("BASE="))
    assert base == f"BASE=rayproject/ray:{version}-py311-cpu"
    assert f"rayproject/ray:{version}-py311-cu" in DOCKERFILE  # the GPU build's base, in the header


def test_the_image_runs_make_install_and_converts_the_default_model_for_cpu():
    runs = " ".join(args for op, args in _instructions() if op == "RUN")
    assert "make install TARGET=${TARGET} VENV=/opt/venv" in runs
    assert 'if [ "${TARGET}" = cpu ]; then make model TARGET=cpu VENV=/opt/venv; fi' in runs
    env = " ".join(args for op, args in _instructions() if op == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env  # KubeRay's `ray start` must be this environment's Ray
    copies = [args for op, args in _instructions() if op == "COPY"]
    assert copies == ["--chown=ray . /app"]  # the whole checkout: `pip install -e .` maps the packages it finds
    # what the manifests say the image holds
    for variant in ("cpu", "gpu"):
        manifest = (ROOT / "k8s" / variant / "rayservice.yaml").read_text()
        assert "/app" in manifest and f"entropic-serve:{variant}" in manifest


def test_dockerignore_keeps_every_file_the_install_and_the_server_read():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    needed = [f for f in tracked if f in ("pyproject.toml", "Makefile") or f.endswith((".py", ".c", ".yml", ".json"))
              and f.split("/")[0] in ("scripts", "kernels", "controller", "deployments", "workers", "loadtest",
                                      "monitoring")]
    assert "kernels/csrc/block_select.c" in needed and "scripts/requirements.py" in needed

    def ignored(path: str) -> bool:
        parts = path.split("/")
        return any(fnmatch.fnmatch(path, p.removeprefix("**/")) or fnmatch.fnmatch(parts[-1], p.removeprefix("**/"))
                   or any(fnmatch.fnmatch(part, p) for part in parts[:-1]) for p in patterns)

    assert [f for f in needed if ignored(f)] == []
    assert ignored(".git/config") and ignored("workers/__pycache__/core.cpython-311.pyc")


def test_the_serve_config_of_the_manifests_starts_what_the_image_has():
    for variant in ("cpu", "gpu"):
        service = yaml.safe_load((ROOT / "k8s" / variant / "rayservice.yaml").read_text())
        apps = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
        assert all((ROOT / (app["import_path"].split(":")[0].replace(".", "/") + ".py")).exists() for app in apps)
