"""`file://` storage: a directory tree on a local or shared file system.

Writes go to a temporary file in the same directory and are renamed into place, so a reader never
sees half an object; `put_if_absent` uses an exclusive create (O_EXCL), which is atomic on POSIX.

A tenant's job input is opened with `open_read_no_symlinks`: its path was resolved and checked to lie
under the tenant's roots at submission, so a symbolic link met on the way to it later (a file swapped
for a link to one outside the roots) is refused, never followed.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from tasks.shared.storage.base import StorageError


def path_of(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise StorageError(f"not a file:// URI: {uri}")
    if parsed.netloc not in ("", "localhost"):
        raise StorageError(f"file:// URIs must be local paths (file:///...), got host {parsed.netloc!r}")
    return Path(unquote(parsed.path))


class LocalStore:
    def open_read(self, uri: str) -> BinaryIO:
        path = path_of(uri)
        try:
            return path.open("rb")
        except FileNotFoundError:
            raise StorageError(f"no such object: {uri}") from None
        except IsADirectoryError:
            raise StorageError(f"{uri} is a directory, not a file") from None
        except PermissionError:
            raise StorageError(f"permission denied reading {uri}") from None

    def open_read_no_symlinks(self, uri: str) -> BinaryIO:
        """Open a regular file at `uri`, an absolute path without symbolic links, following none: each
        directory is opened from the one before with O_NOFOLLOW. Raises `StorageError` for a link on
        the way (ELOOP, ENOTDIR), a missing file, or anything but a regular file (a FIFO would block)."""
        path = path_of(uri)
        if not path.is_absolute():
            raise StorageError(f"not an absolute path: {uri}")
        directory = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        parent = os.open("/", directory)
        try:
            for part in path.parts[1:-1]:
                child = os.open(part, directory, dir_fd=parent)
                os.close(parent)
                parent = child
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            raise _no_symlinks_error(uri, exc) from None
        finally:
            os.close(parent)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageError(f"{uri} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    @contextmanager
    def open_write(self, uri: str) -> Iterator[BinaryIO]:
        path = path_of(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    def put_if_absent(self, uri: str, data: bytes) -> bool:
        path = path_of(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write the body beside the target, then hard-link it into place: link() fails if the
        # target exists, so exactly one writer wins and no reader sees a partial marker.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.link(tmp_name, path)
            return True
        except FileExistsError:
            return False
        finally:
            Path(tmp_name).unlink(missing_ok=True)

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as handle:
            return handle.read()

    def exists(self, uri: str) -> bool:
        return path_of(uri).is_file()

    def size(self, uri: str) -> int:
        try:
            return path_of(uri).stat().st_size
        except FileNotFoundError:
            raise StorageError(f"no such object: {uri}") from None

    def list_prefix(self, uri: str) -> Iterator[str]:
        root = path_of(uri)
        if not root.is_dir():
            return
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
            yield path.as_uri()

    def prefix_bytes(self, uri: str) -> int:
        root = path_of(uri)
        if not root.is_dir():
            return 0
        return sum(path.stat().st_size for path in root.rglob("*") if path.is_file() and not path.is_symlink())

    def delete_prefix(self, uri: str) -> None:
        path = path_of(uri)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _no_symlinks_error(uri: str, exc: OSError) -> StorageError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return StorageError(
            f"{uri} is, or lies under, a symbolic link that was not there when the input was checked; "
            "Batchery does not follow it"
        )
    if exc.errno == errno.ENOENT:
        return StorageError(f"no such object: {uri}")
    if exc.errno == errno.EACCES:
        return StorageError(f"permission denied reading {uri}")
    return StorageError(f"cannot open {uri}: {exc.strerror}")
