"""The versions of the software that runs a model in this process, for a job's provenance."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys

PACKAGES = ("batchery", "torch", "transformers", "sentence-transformers", "peft", "vllm")


@functools.cache
def software_versions() -> dict[str, str]:
    """Python's, each of `PACKAGES` installed, and CUDA's where torch was built for it (read once a process:
    a worker's packages do not change under it)."""
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
    return versions
