"""Digests of a model's files as a slot loaded them: what a job's provenance names its weights by.

`model_digest` hashes every file of the model's directory (SHA-256, read in 1 MiB blocks) and the whole
as the SHA-256 of its sorted ``relative path NUL file digest`` lines, so that one changed, added or removed
file changes it; the tokenizer's digest is the same over the tokenizer's files alone. A ``python`` engine's
model is its code: the digest of the module its entry point names. Dot files (locks, the weights cache's
own markers) are not the model's. A file's digest is kept by path, size and modification time, per
process and for the host (`digests/` beside the weights cache's entries, one small file a digest, written
whole by rename), so the slots of a host hash a model's files once, not once each: a file rewritten to
the same size within the same nanosecond would go unseen.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.settings import model_cache_dir
from gpuworkers.sources import resolve_model_source
from gpuworkers.spec import ModelSpec

BLOCK_BYTES = 1024 * 1024
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)

_known: dict[tuple[str, int, int], str] = {}
_known_lock = threading.Lock()


@dataclass(frozen=True)
class ModelDigest:
    """A loaded model's files, by digest."""

    digest: str
    """``sha256:`` and the hex digest of every file's path and digest."""
    tokenizer_digest: str = ""
    """The same over the tokenizer's files; empty where the model has none."""
    files: dict[str, str] = field(default_factory=dict)
    """Relative path -> hex SHA-256 of each file."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_digest(spec: ModelSpec, *, resolved: Mapping[str, Path] | None = None) -> ModelDigest | None:
    """The digest of the files ``spec`` loads from; None where its source names no files this process can
    read (an engine built by a test from nothing). An ``s3://`` source is digested in the cache directory
    its load resolved it to (``resolved``, the load's `LoadScope.resolved`), never resolved again: that
    would list the bucket and count a cache hit once more."""
    if spec.engine == "python":
        return _module_digest(spec.source)
    if spec.source.startswith("s3://"):
        directory = (resolved or {}).get(spec.source)
        if directory is None:
            return None
    else:
        try:
            directory = resolve_model_source(spec.source)
        except EngineLoadError:
            return None
    files = {
        path.relative_to(directory).as_posix(): _file_digest(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    }
    tokenizer = {name: digest for name, digest in files.items() if Path(name).name in TOKENIZER_FILES}
    return ModelDigest(digest=_combined(files), tokenizer_digest=_combined(tokenizer) if tokenizer else "", files=files)


def _module_digest(entry_point: str) -> ModelDigest | None:
    module = entry_point.partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or not Path(found.origin).is_file():
        return None
    files = {f"{module}.py": _file_digest(Path(found.origin))}
    return ModelDigest(digest=_combined(files), files=files)


def _combined(files: dict[str, str]) -> str:
    lines = "".join(f"{name}\0{digest}\n" for name, digest in sorted(files.items()))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def _file_digest(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _known_lock:
        known = _known.get(key)
    if known is None:
        memo = model_cache_dir() / "digests" / hashlib.sha256(repr(key).encode()).hexdigest()
        known = _read_memo(memo)
        if known is None:
            digest = hashlib.sha256()
            with path.open("rb") as stream:
                while block := stream.read(BLOCK_BYTES):
                    digest.update(block)
            known = digest.hexdigest()
            _write_memo(memo, known)
        with _known_lock:
            _known[key] = known
    return known


def _read_memo(memo: Path) -> str | None:
    try:
        text = memo.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 64 and all(char in "0123456789abcdef" for char in text) else None


def _write_memo(memo: Path, digest: str) -> None:
    """Keep a file's digest for the host's other slots; where the cache is not writable, each hashes its own."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}")
        staging.write_text(digest)
        os.replace(staging, memo)
    except OSError:
        return
