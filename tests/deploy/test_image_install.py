"""The image's build steps, where no container engine can build it: the files the Dockerfile copies,
and its install step (deploy/docker/install.sh) run in a fresh virtual environment, give a project that
imports, passes `manage.py check` and starts the GPU launcher's command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.deploy.deployment_files import REPO
from tests.deploy.test_dockerfile import dockerfile_structure

INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 180
IMAGE_WORKDIR = "/app"


def copy_like_the_dockerfile(app: Path) -> None:
    """Replay the image stage's COPY instructions (context: the repository root) into `app`."""
    structure = dockerfile_structure()
    workdirs = [item["value"] for item in structure if item["instruction"] == "WORKDIR"]
    assert workdirs == [IMAGE_WORKDIR]
    copies = [item["value"].split() for item in structure if item["instruction"] == "COPY"]
    assert copies, "the Dockerfile copies nothing"
    for *sources, destination in copies:
        target = app / destination
        for source in sources:
            path = REPO / source
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            else:
                place = target / path.name if destination.endswith("/") else target
                place.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, place)


def run(command: list[str], *, cwd: Path, env: dict[str, str], timeout: int) -> str:
    try:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(command)} ran past {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.slow
def test_the_cpu_image_install_steps_give_a_working_project(tmp_path: Path) -> None:
    app = tmp_path / "app"
    copy_like_the_dockerfile(app)
    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    # Nothing of this test run's environment (its database, broker, var dir): pip's own settings only.
    env = {name: value for name, value in os.environ.items() if name.startswith("PIP_")}
    env.update(
        PATH=f"{environment / 'bin'}{os.pathsep}{os.environ['PATH']}",
        HOME=os.environ.get("HOME", str(tmp_path)),
        # The CPU torch wheel from pip's configured index (local wheels here), not download.pytorch.org.
        TORCH_INDEX_URL="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    run(["sh", "deploy/docker/install.sh", "cpu"], cwd=app, env=env, timeout=INSTALL_TIMEOUT_S)

    python = str(environment / "bin" / "python")
    assert Path(python).resolve() != Path(sys.executable).resolve()
    found = run(
        [python, "-c", "import portal, tasks, gpuworkers, torch; print(portal.__file__, torch.__version__)"],
        cwd=tmp_path,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    module_file, torch_version = found.split()
    assert Path(module_file).is_relative_to(app), "the project must be installed from the copied tree (editable)"
    assert torch_version.startswith("2.13.0"), torch_version
    run([python, "manage.py", "check"], cwd=app, env=env, timeout=RUN_TIMEOUT_S)
    assert (app / "var" / "static" / "admin").is_dir(), "collectstatic left no admin assets for WhiteNoise"
    usage = run([python, "-m", "gpuworkers", "launch", "--help"], cwd=tmp_path, env=env, timeout=RUN_TIMEOUT_S)
    assert "--gpu-class" in usage
