"""A model's files by digest, as a slot loads them: every file counts, the tokenizer's apart, and a shard's
manifest names them with the software that ran it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from gpuworkers.cache import ModelCache
from gpuworkers.spec import ModelSpec
from gpuworkers.weights.digest import model_digest
from tasks.shared.specs import ShardManifest, ShardSpec
from tasks.slot.shard_execution import execute_shard
from tests.support.tiny_models import build_tiny_causal_lm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-digest"))


def _spec(directory: Path) -> ModelSpec:
    return ModelSpec(name="tiny", version="1", engine="transformers", task="generate", source=str(directory))


def test_every_file_counts_and_the_tokenizers_files_have_a_digest_of_their_own(tiny: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    original = model_digest(_spec(copy))
    assert original is not None
    weights = next(name for name in original.files if name.endswith(".safetensors"))
    assert original.files[weights] == hashlib.sha256((copy / weights).read_bytes()).hexdigest()
    assert original.tokenizer_digest and original.tokenizer_digest != original.digest

    (copy / ".lock").write_text("a download's lock is not the model")
    assert model_digest(_spec(copy)) == original

    data = bytearray((copy / weights).read_bytes())
    data[-1] ^= 1
    (copy / weights).write_bytes(bytes(data))
    changed = model_digest(_spec(copy))
    assert changed is not None
    assert changed.digest != original.digest
    assert changed.tokenizer_digest == original.tokenizer_digest, "the same tokenizer"

    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    retokenized = model_digest(_spec(copy))
    assert retokenized is not None and retokenized.tokenizer_digest != changed.tokenizer_digest


def test_a_python_models_digest_is_its_modules_and_a_source_of_nothing_has_none() -> None:
    spec = ModelSpec(name="echo", version="1", engine="python", task="classify", source="tests.support.chaos_engines:x")
    found = model_digest(spec)
    assert found is not None and list(found.files) == ["tests.support.chaos_engines.py"]
    assert model_digest(_spec(Path("/nowhere"))) is None


def test_the_cache_reads_the_digest_at_load_and_a_shard_manifest_names_it_with_the_software(
    tiny: Path, tmp_path: Path
) -> None:
    lookup = ModelCache().get(_spec(tiny), device="cpu")
    assert lookup.files == model_digest(_spec(tiny))

    path = tmp_path / "input.jsonl"
    path.write_text('{"custom_id": "a", "prompt": "Hello"}\n')
    spec = ShardSpec(
        job_id="provenance",
        shard_index=0,
        record_count=1,
        input_uri=path.as_uri(),
        shard_prefix=(tmp_path / "shard").as_uri(),
        model=_spec(tiny),
        input_field="prompt",
        params={"max_tokens": 2},
    )
    manifest = execute_shard(spec, worker="w1")

    assert isinstance(manifest, ShardManifest)
    model = manifest.provenance["model"]
    assert lookup.files is not None
    assert model["weights_digest"] == lookup.files.digest
    assert model["tokenizer_digest"] == lookup.files.tokenizer_digest
    assert {"python", "batchery", "torch", "transformers"} <= set(manifest.provenance["versions"])
    assert manifest.provenance["device"] == "cpu"


def test_a_hosts_slots_hash_a_file_once_sharing_its_digest_beside_the_weights_cache(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuworkers.weights import digest as digests

    monkeypatch.setenv("BATCHERY_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    first = model_digest(_spec(copy))
    assert first is not None
    memos = list((tmp_path / "cache" / "digests").iterdir())
    assert len(memos) == len(first.files)

    # Another slot's process (nothing known in memory) reads the host's digests instead of the files.
    monkeypatch.setattr(digests, "_known", {})
    for memo in memos:
        memo.write_text("f" * 64)
    assert set(model_digest(_spec(copy)).files.values()) == {"f" * 64}  # type: ignore[union-attr]
