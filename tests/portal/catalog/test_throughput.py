"""The learned throughput: the decayed least-squares fit of seconds = a * records + b * chars, its
guards, its defaults for a model that never ran, concurrent observations and the admin's view."""

from __future__ import annotations

import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client

from portal.catalog.models import GpuClass, Model, ModelThroughput
from portal.catalog.throughput import DECAY, CostModel, throughput_estimate, throughput_observe, throughput_observe_many
from tests.factories import GpuClassFactory, ModelFactory

PER_RECORD = 0.004
PER_CHAR = 0.00002


def _observe(model: Model, records: int, chars: int, seconds: float, gpu_class: GpuClass | None = None) -> None:
    throughput_observe(
        model_id=model.pk,
        gpu_class_id=(gpu_class or model.gpu_class).pk,
        records=records,
        chars=chars,
        seconds=seconds,
    )


@pytest.mark.django_db
def test_the_fit_recovers_both_rates_from_noisy_shards_within_a_few_percent(minilm: Model) -> None:
    rng = random.Random(7)
    for _ in range(200):
        records = rng.randint(10, 1000)
        chars = records * rng.randint(20, 2000)
        noise = 1 + rng.uniform(-0.03, 0.03)
        _observe(minilm, records, chars, (PER_RECORD * records + PER_CHAR * chars) * noise)

    cost = throughput_estimate(minilm)

    assert cost.observed
    assert cost.per_record_s == pytest.approx(PER_RECORD, rel=0.03)
    assert cost.per_char_s == pytest.approx(PER_CHAR, rel=0.03)
    assert cost.seconds(100, 40_000) == pytest.approx(100 * PER_RECORD + 40_000 * PER_CHAR, rel=0.02)


@pytest.mark.django_db
def test_recent_shards_outweigh_old_ones_so_the_estimate_follows_a_slowdown(minilm: Model) -> None:
    rng = random.Random(11)

    def shards(slowdown: float) -> None:
        for _ in range(100):
            records = rng.randint(10, 500)
            chars = records * rng.randint(20, 1000)
            _observe(minilm, records, chars, slowdown * (PER_RECORD * records + PER_CHAR * chars))

    shards(1.0)
    shards(2.0)

    reference = PER_RECORD * 100 + PER_CHAR * 40_000
    ratio = throughput_estimate(minilm).seconds(100, 40_000) / reference
    # Equal weights would put the 100 old and 100 new shards at 1.5 times the old seconds; with a
    # decay of 0.98 a shard 100 observations old weighs 0.13, and the estimate is near 2.
    assert DECAY == 0.98
    assert ratio == pytest.approx(1.88, abs=0.03)


@pytest.mark.django_db
def test_a_single_shard_gives_a_per_record_rate_and_nothing_per_char(minilm: Model) -> None:
    _observe(minilm, 100, 5_000, 10.0)

    cost = throughput_estimate(minilm)

    assert cost == CostModel(per_record_s=0.1, per_char_s=0.0, observed=True)


@pytest.mark.django_db
def test_shards_all_alike_in_length_fall_back_to_the_per_record_rate_that_predicts_them(minilm: Model) -> None:
    for records in (10, 50, 200, 1000, 30):
        chars = 50 * records  # every record 50 characters long: records and chars cannot be told apart
        _observe(minilm, records, chars, PER_RECORD * records + PER_CHAR * chars)

    cost = throughput_estimate(minilm)

    assert cost.per_char_s == 0.0
    assert cost.per_record_s == pytest.approx(PER_RECORD + 50 * PER_CHAR)
    assert cost.seconds(400, 20_000) == pytest.approx(400 * PER_RECORD + 20_000 * PER_CHAR)


@pytest.mark.django_db
def test_rates_are_never_negative_even_when_longer_shards_ran_faster(minilm: Model) -> None:
    # Seconds fall as characters grow: the unconstrained fit would give chars a negative rate.
    for records, chars in [(100, 1_000), (100, 50_000), (200, 4_000), (200, 90_000), (50, 20_000)]:
        _observe(minilm, records, chars, 0.05 * records - 0.00005 * chars)

    cost = throughput_estimate(minilm)

    assert cost.per_char_s == 0.0
    assert cost.per_record_s > 0


def test_the_fit_of_a_row_without_observations_is_zero() -> None:
    assert ModelThroughput().rates() == (0.0, 0.0)


@pytest.mark.django_db
def test_a_shard_with_no_records_or_impossible_seconds_is_not_learned_from(minilm: Model) -> None:
    _observe(minilm, 0, 0, 1.0)
    _observe(minilm, 10, 100, float("nan"))
    _observe(minilm, 10, 100, -1.0)
    assert not ModelThroughput.objects.exists()


@pytest.mark.django_db
def test_a_model_that_never_ran_is_estimated_from_settings_or_its_declared_rate(minilm: Model, settings: Any) -> None:
    settings.BATCHERY_DEFAULT_SECONDS_PER_RECORD = 0.05
    assert throughput_estimate(minilm) == CostModel(per_record_s=0.05, per_char_s=0.0, observed=False)

    declared = ModelFactory(
        name="declared", is_default=False, default_params={"seconds_per_record": 0.2, "seconds_per_char": 0.001}
    )
    assert throughput_estimate(declared) == CostModel(per_record_s=0.2, per_char_s=0.001, observed=False)

    nonsense = ModelFactory(name="nonsense", is_default=False, default_params={"seconds_per_record": "fast"})
    assert throughput_estimate(nonsense).per_record_s == 0.05


@pytest.mark.django_db
def test_the_estimate_is_per_gpu_class(minilm: Model) -> None:
    fast = GpuClassFactory(name="h100")
    _observe(minilm, 100, 1_000, 1.0, gpu_class=fast)

    assert throughput_estimate(minilm, fast.pk).per_record_s == pytest.approx(0.01)
    assert throughput_estimate(minilm, fast.pk).observed
    assert not throughput_estimate(minilm).observed


@pytest.mark.django_db(transaction=True)
def test_concurrent_observations_each_count_once_including_the_first_that_creates_the_row() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL")
    model = ModelFactory()
    threads, each = 8, 25
    start = threading.Barrier(threads)

    def observe(_: int) -> None:
        try:
            start.wait(timeout=30)
            for _ in range(each):
                _observe(model, 10, 500, 1.0)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(observe, range(threads)))

    row = ModelThroughput.objects.get(model=model, gpu_class=model.gpu_class)
    count = threads * each
    assert row.observations == count
    assert row.weight == pytest.approx((1 - DECAY**count) / (1 - DECAY))
    assert row.sum_rr == pytest.approx(100 * (1 - DECAY**count) / (1 - DECAY))


@pytest.mark.django_db
def test_the_admin_shows_a_models_learned_rates_read_only(minilm: Model) -> None:
    _observe(minilm, 100, 5_000, 10.0)
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "secret-password"))

    page = client.get(f"/admin/catalog/model/{minilm.pk}/change/").content.decode()

    assert "Learned throughput" in page
    assert re.search(r'field-per_record_s">\s*<p>0.1</p>', page)
    assert re.search(r'field-per_char_s">\s*<p>0</p>', page)
    assert 'name="throughputs-0-gpu_class"' not in page  # shown, not editable


@pytest.mark.django_db
def test_shards_learned_from_together_weigh_what_they_weigh_one_at_a_time(minilm: Model) -> None:
    rng = random.Random(5)
    shards = [(n := rng.randint(10, 500), n * rng.randint(20, 1000), rng.uniform(0.5, 9.0)) for _ in range(40)]
    other = GpuClassFactory(name="batched")
    for records, chars, seconds in shards[:7]:
        _observe(minilm, records, chars, seconds)
        _observe(minilm, records, chars, seconds, gpu_class=other)
    for records, chars, seconds in shards[7:]:
        _observe(minilm, records, chars, seconds)
    throughput_observe_many(model_id=minilm.pk, gpu_class_id=other.pk, shards=shards[7:])

    one_at_a_time = ModelThroughput.objects.get(model=minilm, gpu_class=minilm.gpu_class)
    together = ModelThroughput.objects.get(model=minilm, gpu_class=other)
    assert together.observations == one_at_a_time.observations == 40
    for name in ("weight", "sum_rr", "sum_rc", "sum_cc", "sum_rt", "sum_ct"):
        assert getattr(together, name) == pytest.approx(getattr(one_at_a_time, name), rel=1e-9), name
