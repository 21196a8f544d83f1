"""A private PostgreSQL cluster for tests that restart the database, built from the machine's
PostgreSQL binaries (run as the `postgres` user when the tests run as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from portal.devstack.embedded import free_port


def _bin_dir() -> Path | None:
    root = Path("/usr/lib/postgresql")
    versions = sorted(root.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0) if root.exists() else []
    return versions[-1] / "bin" if versions else None


def available() -> bool:
    return _bin_dir() is not None


@dataclass
class PrivatePostgres:
    data_dir: Path
    port: int
    bin_dir: Path

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/batchery"

    def _run(self, *args: str) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data_dir), "-o", options, "-l", str(self.data_dir / "log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        shutil.rmtree(self.data_dir.parent, ignore_errors=True)

    @classmethod
    def create(cls) -> PrivatePostgres:
        bin_dir = _bin_dir()
        assert bin_dir is not None, "no PostgreSQL binaries on this machine"
        # Not under pytest's tmp_path: its folders are private to root, and the server runs as postgres.
        parent = Path(tempfile.mkdtemp(prefix="batchery-pg-"))
        data_dir = parent / "pgdata"
        data_dir.mkdir()
        if os.geteuid() == 0:
            shutil.chown(parent, "postgres")
            shutil.chown(data_dir, "postgres")
        cluster = cls(data_dir=data_dir, port=free_port(), bin_dir=bin_dir)
        cluster._run("initdb", "-D", str(data_dir), "-A", "trust", "-U", "postgres", "--no-sync")
        cluster.start()
        cluster._run("createdb", "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres", "batchery")
        return cluster
