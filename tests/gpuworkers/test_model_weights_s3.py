"""Model weights from an s3:// prefix through the host's disk cache, against a real moto_server process.

Slots are real processes here: two that resolve the same model at the same moment, one that holds
a model loaded, one killed mid-download. The server's request log counts what was really fetched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuworkers import settings
from gpuworkers.cache import ModelCache
from gpuworkers.engines.base import EngineLoadError
from gpuworkers.metrics_server import metrics_registry, prepare_metrics_dir
from gpuworkers.sources import resolve_model_source
from gpuworkers.spec import ModelSpec
from gpuworkers.weights import WeightsUnavailableError, client, holds, resolve
from gpuworkers.weights.holds import exclusive_if_unused
from gpuworkers.weights.listing import list_source
from tasks.shared.env import ImproperlyConfiguredEnv
from tests.support.moto_server import ARTIFACTS, running_moto_server
from tests.support.tcp_proxy import TcpProxy
from tests.support.workers import REPO

pytestmark = pytest.mark.timeout(120)

KIB = 1024
MIB = 1024 * KIB
PART_BYTES = MIB
"""The tests' download part size, so that a file of a few MiB is fetched as parallel ranged GETs."""

RESOLVE = """
import json, os, sys, time
from pathlib import Path
from gpuworkers.sources import resolve_model_source
from gpuworkers.weights import holds

source, sync = sys.argv[1], Path(sys.argv[2])
(sync / f"ready-{os.getpid()}").touch()
while not (sync / "go").exists():
    time.sleep(0.001)
with holds.load_scope("tiny"):
    path = resolve_model_source(source)
print(json.dumps({"path": str(path)}), flush=True)
# Stay loaded (the entry held) until told to go.
if len(sys.argv) > 3:
    sys.stdin.read()
"""


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with running_moto_server() as url:
        yield url


@pytest.fixture
def env(moto_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A slot's environment: the S3 endpoint and credentials, a cache directory of the test's own."""
    values = {
        "AWS_ENDPOINT_URL": moto_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "BATCHERY_MODEL_CACHE_DIR": str(tmp_path / "cache"),
        "BATCHERY_MODEL_DOWNLOAD_PART_BYTES": str(PART_BYTES),
        "BATCHERY_MODEL_DOWNLOAD_CONCURRENCY": "4",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    # This process's client and store are built from this test's environment.
    monkeypatch.setattr(client, "_clients", client.S3Clients())
    monkeypatch.setattr(resolve, "_stores", {})
    return values


@pytest.fixture
def admin(moto_url: str, env: dict[str, str]) -> Any:
    """A plain boto3 client to set up buckets behind the cache's back."""
    return boto3.client("s3", endpoint_url=moto_url)


@pytest.fixture
def bucket(admin: Any) -> str:
    name = f"weights-{uuid.uuid4().hex[:12]}"
    admin.create_bucket(Bucket=name)
    return name


def upload(admin: Any, bucket: str, prefix: str, files: dict[str, bytes]) -> str:
    for path, data in files.items():
        admin.put_object(Bucket=bucket, Key=f"{prefix}/{path}", Body=data)
    return f"s3://{bucket}/{prefix}/"


def model_files(seed: int, weights_bytes: int) -> dict[str, bytes]:
    """A model directory: small JSON files and one weights file of ``weights_bytes`` bytes."""
    return {
        "config.json": json.dumps({"seed": seed}).encode(),
        "tokenizer/vocab.txt": b"\n".join(b"token%d" % n for n in range(1000)),
        "model.safetensors": os.urandom(weights_bytes),
    }


def three_models(admin: Any, bucket: str) -> dict[str, str]:
    """Models a, b and c of about 300 KiB each, by name to source."""
    return {
        name: upload(admin, bucket, name, model_files(seed=seed, weights_bytes=300 * KIB))
        for seed, name in enumerate("abc")
    }


def read_tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def object_gets(moto_url: str, bucket: str) -> list[str]:
    """The keys of every GetObject the server answered for ``bucket``, one per request (ranged GETs too)."""
    log = ARTIFACTS / "logs" / f"moto-server-{moto_url.rsplit(':', 1)[1]}.log"
    pattern = re.compile(rf'"GET /{re.escape(bucket)}/([^ ?]+)[^"]* HTTP/1\.1" 20[06]')
    # The server colours the lines of partial answers (206) with terminal escapes.
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
    return [match.group(1) for match in pattern.finditer(text)]


def cache_dirs(env: dict[str, str]) -> tuple[list[str], list[str]]:
    """(names under entries/, names under tmp/) of the test's cache."""
    root = Path(env["BATCHERY_MODEL_CACHE_DIR"])
    return sorted(p.name for p in (root / "entries").iterdir()), sorted(p.name for p in (root / "tmp").iterdir())


def start_resolver(source: str, sync: Path, env: dict[str, str], *, stay: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", RESOLVE, source, str(sync), *(["stay"] if stay else [])]
    return subprocess.Popen(
        argv, cwd=REPO, env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.002)
    return result


def metric_values(directory: Path) -> dict[str, float]:
    """The weight-cache samples every process wrote to a multiprocess directory, summed by name."""
    text = generate_latest(metrics_registry(directory, lambda: [], None)).decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("batchery_weights_"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


class ThrottledProxy(TcpProxy):
    """The storage tests' proxy, slowed to about 30 MB/s so that a test can cut a download halfway."""

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(64 * KIB):
                target.sendall(chunk)
                time.sleep(0.002)
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)
        with self._lock:
            self._open.discard(source)


@pytest.fixture
def slow_proxy(moto_url: str) -> Iterator[ThrottledProxy]:
    proxy = ThrottledProxy(int(moto_url.rsplit(":", 1)[1]))
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()


def staged_bytes(env: dict[str, str]) -> int:
    tmp = Path(env["BATCHERY_MODEL_CACHE_DIR"]) / "tmp"
    total = 0
    # The download renames its part files and directories while this walks them: os.walk skips a directory that
    # vanished, and a file listed may be gone by its stat.
    for directory, _, names in os.walk(tmp):
        for name in names:
            try:
                total += os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                continue
    return total


# 1. Two slots, one download


def test_two_slots_resolving_at_the_same_moment_download_once_and_share_the_directory(
    env: dict[str, str], admin: Any, bucket: str, moto_url: str, tmp_path: Path
) -> None:
    files = model_files(seed=1, weights_bytes=6 * MIB + 123)
    source = upload(admin, bucket, "tiny/v1", files)
    metrics_dir = prepare_metrics_dir(tmp_path / "metrics")
    slot_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    sync = tmp_path / "sync"
    sync.mkdir()

    slots = [start_resolver(source, sync, slot_env) for _ in range(2)]
    wait_for(lambda: len(list(sync.glob("ready-*"))) == 2, timeout_s=30, what="both slots ready")
    (sync / "go").touch()
    outputs = [json.loads(slot.communicate(timeout=60)[0]) for slot in slots]

    assert [slot.returncode for slot in slots] == [0, 0]
    assert outputs[0]["path"] == outputs[1]["path"]
    assert read_tree(Path(outputs[0]["path"])) == files
    gets = object_gets(moto_url, bucket)
    # Once each: the weights file as its 7 ranged GETs (6 MiB + 123 bytes in parts of 1 MiB), the others whole.
    assert sorted(gets) == sorted(
        ["tiny/v1/config.json", "tiny/v1/tokenizer/vocab.txt"] + ["tiny/v1/model.safetensors"] * 7
    )
    values = metric_values(metrics_dir)
    assert values["batchery_weights_cache_misses_total"] == 1
    assert values["batchery_weights_cache_hits_total"] == 1, "the second slot waited, then used the entry"
    assert values["batchery_weights_download_bytes_total"] == sum(map(len, files.values()))
    assert values["batchery_weights_download_duration_seconds_count"] == 1
    assert values["batchery_weights_cache_bytes"] == sum(map(len, files.values())), "one host, read once"

    again = start_resolver(source, sync, slot_env)
    assert json.loads(again.communicate(timeout=60)[0])["path"] == outputs[0]["path"]
    assert len(object_gets(moto_url, bucket)) == len(gets), "a second resolve fetches nothing"
    assert metric_values(metrics_dir)["batchery_weights_cache_hits_total"] == 2


# 2. Cut downloads


def test_a_download_cut_midway_leaves_no_entry_and_the_next_attempt_completes(
    env: dict[str, str], admin: Any, bucket: str, slow_proxy: ThrottledProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files(seed=2, weights_bytes=16 * MIB)
    source = upload(admin, bucket, "tiny/v1", files)
    monkeypatch.setenv("AWS_ENDPOINT_URL", slow_proxy.url)
    monkeypatch.setenv("BATCHERY_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("BATCHERY_MODEL_DOWNLOAD_CONCURRENCY", "1")
    outcome: list[BaseException | Path] = []

    def run() -> None:
        try:
            outcome.append(resolve_model_source(source))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: staged_bytes(env) > 2 * MIB, timeout_s=30, what="a download under way")
    slow_proxy.down()
    worker.join(timeout=60)

    assert isinstance(outcome[0], WeightsUnavailableError), outcome
    assert cache_dirs(env) == ([], []), "no entry, no marker, no temporary directory"
    slow_proxy.up()
    path = resolve_model_source(source)
    assert read_tree(path) == files
    assert cache_dirs(env)[0] == [path.name, f"{path.name}.ready"]


def test_a_slot_killed_mid_download_leaves_a_partial_download_that_the_next_open_sweeps(
    env: dict[str, str], admin: Any, bucket: str, slow_proxy: ThrottledProxy, tmp_path: Path
) -> None:
    files = model_files(seed=3, weights_bytes=16 * MIB)
    source = upload(admin, bucket, "tiny/v1", files)
    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / "go").touch()

    slot = start_resolver(source, sync, {**env, "AWS_ENDPOINT_URL": slow_proxy.url})
    wait_for(lambda: staged_bytes(env) > 2 * MIB, timeout_s=30, what="a download under way")
    slot.send_signal(signal.SIGKILL)
    slot.wait(timeout=10)
    assert len(cache_dirs(env)[1]) == 1, "the killed slot's partial download"

    store = resolve.open_store()  # what a slot does first
    assert cache_dirs(env) == ([], [])
    assert store.held_bytes() == 0
    assert read_tree(resolve_model_source(source)) == files


# 3. Eviction


def test_the_least_recently_used_entry_is_evicted_to_stay_within_the_budget(
    env: dict[str, str], admin: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = {
        name: upload(admin, bucket, name, model_files(seed=n, weights_bytes=300 * KIB)) for n, name in enumerate("abc")
    }
    monkeypatch.setenv("BATCHERY_MODEL_CACHE_BYTES", str(700 * KIB))  # two models and a bit
    paths = {}
    for name in ("a", "b", "a", "c"):  # a used again after b: b is the least recently used
        with holds.load_scope(name) as scope:
            paths[name] = resolve_model_source(sources[name])
        scope.release()  # unloaded at once
        time.sleep(0.01)

    assert paths["a"].is_dir() and paths["c"].is_dir()
    assert not paths["b"].exists()
    assert resolve.open_store().held_bytes() <= 700 * KIB


def test_an_entry_loaded_by_another_slot_is_not_evicted_even_when_least_recently_used(
    env: dict[str, str], admin: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sources = {
        name: upload(admin, bucket, name, model_files(seed=n, weights_bytes=300 * KIB)) for n, name in enumerate("abc")
    }
    monkeypatch.setenv("BATCHERY_MODEL_CACHE_BYTES", str(700 * KIB))
    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / "go").touch()
    holder = start_resolver(sources["a"], sync, env, stay=True)
    assert holder.stdout is not None and holder.stdin is not None
    held = Path(json.loads(holder.stdout.readline())["path"])
    try:
        with holds.load_scope("b") as scope:
            b = resolve_model_source(sources["b"])
        scope.release()
        with holds.load_scope("c") as scope:
            c = resolve_model_source(sources["c"])
        scope.release()

        assert held.is_dir(), "a is the least recently used, but another slot has it loaded"
        assert not b.exists() and c.is_dir()
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    # Once that slot is gone, a is the first to go.
    with holds.load_scope("b") as scope:
        resolve_model_source(sources["b"])
    scope.release()
    assert not held.exists() and c.is_dir()


class _S3Engine:
    """An engine whose load resolves its source, as the real engines do, and holds nothing else."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def load(self, *, device: str) -> None:
        self.path = resolve_model_source(self.spec.source)

    def memory_bytes(self) -> int:
        return 1

    def unload(self) -> None:
        pass

    def run_batch(self, inputs: Any, params: Any) -> list[dict[str, Any]]:
        return []


def test_a_model_in_the_warm_cache_pins_its_entry_until_the_warm_cache_unloads_it(
    env: dict[str, str], admin: Any, bucket: str
) -> None:
    source = upload(admin, bucket, "tiny/v1", model_files(seed=4, weights_bytes=10 * KIB))
    spec = ModelSpec(name="tiny", version="1", engine="python", task="embed", source=source)
    cache = ModelCache(budget_bytes=10, engine_factory=_S3Engine)
    engine = cache.get(spec, device="cpu").engine
    assert isinstance(engine, _S3Engine)
    in_use = Path(env["BATCHERY_MODEL_CACHE_DIR"]) / "locks" / f"{engine.path.name}.inuse"

    with exclusive_if_unused(in_use) as unused:
        assert not unused, "loaded, so held"
    cache.clear()
    with exclusive_if_unused(in_use) as unused:
        assert unused, "unloaded, so free to evict"


# 4. Content addressing


def test_a_new_upload_under_the_same_prefix_is_a_new_entry_and_an_unchanged_one_is_not_fetched_again(
    env: dict[str, str], admin: Any, bucket: str, moto_url: str
) -> None:
    files = model_files(seed=5, weights_bytes=2 * MIB)
    source = upload(admin, bucket, "tiny", files)
    with holds.load_scope("tiny") as scope:
        first = resolve_model_source(source)
        fetched = len(object_gets(moto_url, bucket))
        assert resolve_model_source(source) == first
        assert len(object_gets(moto_url, bucket)) == fetched, "unchanged: listed, not fetched"

        changed = {**files, "config.json": b'{"seed": 6}'}
        upload(admin, bucket, "tiny", {"config.json": changed["config.json"]})
        second = resolve_model_source(source)
    scope.release()

    assert second != first
    assert read_tree(second) == changed
    assert read_tree(first) == files, "the old entry stays until evicted"


def test_a_file_that_arrives_corrupt_is_refused_and_leaves_no_entry(
    env: dict[str, str], admin: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = upload(admin, bucket, "tiny", model_files(seed=7, weights_bytes=10 * KIB))
    from gpuworkers.weights import download

    real_md5 = download._md5
    monkeypatch.setattr(download, "_md5", lambda path: "0" * 32 if path.name == "config.json" else real_md5(path))

    with pytest.raises(WeightsUnavailableError, match=r"config\.json does not match its MD5 ETag"):
        resolve_model_source(source)
    assert cache_dirs(env) == ([], [])


# 5. Bad input


def test_a_prefix_with_no_objects_is_a_load_error_naming_the_source(env: dict[str, str], bucket: str) -> None:
    with pytest.raises(EngineLoadError, match=re.escape(f"model source 's3://{bucket}/nothing/here/'")):
        resolve_model_source(f"s3://{bucket}/nothing/here/")


def test_a_missing_bucket_is_a_load_error_not_a_transient_one(env: dict[str, str]) -> None:
    with pytest.raises(EngineLoadError, match="s3://no-such-bucket-here/m/"):
        resolve_model_source("s3://no-such-bucket-here/m/")


def test_the_cache_settings_have_safe_defaults_and_refuse_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHERY_MODEL_CACHE_DIR", raising=False)
    monkeypatch.delenv("BATCHERY_MODEL_CACHE_BYTES", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/cache")
    assert settings.model_cache_dir() == Path("/srv/cache/batchery/models")
    assert settings.model_cache_bytes() == 100 * 1024**3
    monkeypatch.setenv("BATCHERY_MODEL_CACHE_BYTES", "lots")
    with pytest.raises(ImproperlyConfiguredEnv, match="BATCHERY_MODEL_CACHE_BYTES"):
        settings.model_cache_bytes()


class _ListingClient:
    """Answers one listing page, as S3 would for keys a real server may hold but a test cannot upload."""

    def __init__(self, keys: list[str]) -> None:
        self.page = {"Contents": [{"Key": key, "Size": 1, "ETag": '"e"'} for key in keys]}

    def get_paginator(self, name: str) -> Any:
        return self

    def paginate(self, **kwargs: Any) -> list[dict[str, Any]]:
        return [self.page]


@pytest.mark.parametrize("key", ["m/../../etc/cron.d/x", "m//x", "m/./x"])
def test_an_object_whose_path_would_leave_the_model_directory_is_refused(key: str) -> None:
    with pytest.raises(EngineLoadError, match="would land outside the model directory"):
        list_source(_ListingClient(["m/config.json", key]), "s3://bucket/m/")


def test_folder_markers_are_not_files_of_the_model() -> None:
    listing = list_source(_ListingClient(["m/", "m/sub/", "m/sub/config.json"]), "s3://bucket/m")

    assert [item.path for item in listing.objects] == ["sub/config.json"]
