"""Where a model's weights come from: a catalog source string resolved to a local directory.

Weights come from disk, from a package that ships them, or from an ``s3://`` prefix through the
host's weight cache (`gpuworkers.weights`), never from a model hub at run time;
`forbid_hub_downloads` makes the Hugging Face libraries fail instead of downloading.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.weights.resolve import resolve_s3_source


def resolve_model_source(source: str) -> Path:
    """The local directory that holds the weights ``source`` names.

    ``package:NAME`` is the directory package NAME's ``get_model_path()`` returns, or the package's
    own directory; ``file:///abs/path`` and plain paths are local directories; ``s3://bucket/prefix/``
    is this host's cached copy of the prefix, downloaded when missing and kept from eviction while
    the model loading now stays loaded.
    """
    if source.startswith("s3://"):
        return resolve_s3_source(source)
    if source.startswith("package:"):
        path = _package_directory(source, source.removeprefix("package:"))
    elif source.startswith("file://"):
        parsed = urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise EngineLoadError(f"model source {source!r}: file:// URLs must name a local path")
        path = Path(unquote(parsed.path))
    elif "://" in source:
        scheme = source.partition("://")[0]
        raise EngineLoadError(f"unsupported model source scheme {scheme!r} in {source!r}")
    else:
        path = Path(source).expanduser()
    if not path.is_dir():
        raise EngineLoadError(f"model source {source!r}: no directory at {path}")
    return path


def _package_directory(source: str, package_name: str) -> Path:
    if not package_name:
        raise EngineLoadError(f"model source {source!r} names no package")
    try:
        package = importlib.import_module(package_name)
    except ImportError as exc:
        raise EngineLoadError(f"model source {source!r}: cannot import {package_name!r}: {exc}") from exc
    get_model_path = getattr(package, "get_model_path", None)
    if callable(get_model_path):
        return Path(get_model_path())
    if package.__file__ is not None:
        return Path(package.__file__).parent
    # A namespace package has no __file__, only its search path.
    return Path(next(iter(package.__path__)))


def forbid_hub_downloads() -> None:
    """Make huggingface_hub and transformers refuse network access; call before importing them.

    setdefault, so that an operator who really wants the hub can still say so explicitly.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
