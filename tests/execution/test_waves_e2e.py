"""Waves with real workers: a job of short shards on four slots goes out in chords of several shards,
each settled by one callback, and every record ends exactly once, also when a shard of a wave hangs
until its hard time limit or kills its worker process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from portal.catalog.models import Model
from tests.execution.conftest import SECONDS_PER_RECORD, ended
from tests.support.chaos import ChaosStack, check_exactly_once, write_records
from tests.support.chaos_engines import HANG_MARKER, POISON_MARKER

SHARDS = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _callbacks_received(sim: ChaosStack) -> int:
    """The `shard_done` callbacks the control worker took, from its log."""
    return len(re.findall(r"batchery\.shard_done\[[^\]]+\] received", sim.workers["control"].log_path.read_text()))


def _run(sim: ChaosStack, tmp_path: Path, model: str, texts: list[str]) -> tuple[object, int]:
    path = tmp_path / f"{model}.jsonl"
    ids = write_records(path, texts)
    before = _callbacks_received(sim)
    job = ended(sim.submit(model=model, input_path=path, shard_size=1), sim)
    check_exactly_once(f"waves, {model}", job, ids, 0)
    return job, _callbacks_received(sim) - before


def test_short_shards_go_in_waves_settled_by_one_callback_each(sim: ChaosStack, tmp_path: Path) -> None:
    job, callbacks = _run(sim, tmp_path, "fair-echo", [f"record {n}" for n in range(SHARDS)])

    assert job.status == "succeeded"
    assert job.shard_count == SHARDS
    # 1 ms shards on four slots: a slot's 64 places make two waves of 32, so a handful of callbacks
    # (and the waves of the job's tail, cut smaller as fewer shards wait).
    assert callbacks <= SHARDS // 4, f"{callbacks} callbacks for {SHARDS} shards"


@pytest.mark.parametrize(
    ("factory", "marker"),
    [("hang", HANG_MARKER), ("poison", POISON_MARKER)],
    ids=["hangs until its hard limit", "kills its worker"],
)
def test_a_shard_that_fails_inside_a_wave_leaves_the_rest_of_its_wave_settled(
    sim: ChaosStack, tmp_path: Path, factory: str, marker: str
) -> None:
    from tests.factories import ModelFactory

    ModelFactory(
        name=f"wave-{factory}",
        engine=Model.Engine.PYTHON,
        task=Model.Task.CLASSIFY,
        source=f"tests.support.chaos_engines:{factory}_factory",
        default_params={
            "seconds_per_record": SECONDS_PER_RECORD,
            "time_limit_base_s": 3,
            "time_limit_per_record_s": 0,
        },
        is_default=False,
    )
    texts = [f"record {n}" for n in range(SHARDS)]
    texts[37] += f" {marker}"

    job, callbacks = _run(sim, tmp_path, f"wave-{factory}", texts)

    assert job.status == "partially_succeeded", job.error
    assert job.failed_records == 1
    assert callbacks < SHARDS // 2, f"{callbacks} callbacks for {SHARDS} shards: not sent in waves"
