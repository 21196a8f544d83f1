"""Throughput: how long a shard of a model takes on a GPU class, learned from finished shards.

The scheduler calls `throughput_observe` when a shard finishes; the planner calls
`throughput_estimate` to cut a job's input into shards of about equal cost (`jobs/services/shard_cut.py`).
The fit itself is `ModelThroughput.rates`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F

from portal.catalog.models import Model, ModelThroughput

logger = logging.getLogger(__name__)

# Each new shard weighs 1 and every earlier one 0.98 times what it weighed before: the fit follows
# about the last 50 shards (1 / (1 - 0.98)), enough to average out noise, few enough to notice
# within an hour that a model was moved to faster hardware or a new engine version.
DECAY = 0.98


@dataclass(frozen=True)
class CostModel:
    """Predicts a shard's compute seconds as `per_record_s * records + per_char_s * chars`."""

    per_record_s: float
    """Seconds each record costs whatever its length (batching, per-call overhead)."""
    per_char_s: float
    """Seconds each character of a record's input text costs."""
    observed: bool
    """True when learned from finished shards; False: a default, the model never ran on the class."""

    def seconds(self, records: int, chars: int) -> float:
        return self.per_record_s * records + self.per_char_s * chars


def throughput_observe(*, model_id: int, gpu_class_id: int, records: int, chars: int, seconds: float) -> None:
    """Learn from one finished shard: `records` records of `chars` input characters in `seconds`."""
    throughput_observe_many(model_id=model_id, gpu_class_id=gpu_class_id, shards=[(records, chars, seconds)])


def throughput_observe_many(*, model_id: int, gpu_class_id: int, shards: Sequence[tuple[int, int, float]]) -> None:
    """Learn from finished shards, each `(records, chars, seconds)`, in the order they finished.

    One conditional UPDATE whose new values are computed from the stored ones (F expressions), so
    concurrent calls for the same model and class each count once; the first call creates the row.
    The k shards of one call weigh what k calls of one would: the stored sums decay by DECAY**k and
    the i-th shard (0-based) by DECAY**(k-1-i).
    """
    valid = []
    for records, chars, seconds in shards:
        if records < 1 or chars < 0 or not math.isfinite(seconds) or seconds < 0:
            logger.warning(
                "throughput of model %s on class %s: ignoring records=%s chars=%s seconds=%s",
                model_id,
                gpu_class_id,
                records,
                chars,
                seconds,
            )
            continue
        valid.append((float(records), float(chars), float(seconds)))
    if not valid:
        return
    k = len(valid)
    weights = [DECAY ** (k - 1 - i) for i in range(k)]
    sums = {
        "weight": sum(weights),
        "sum_rr": sum(w * r * r for w, (r, _, _) in zip(weights, valid, strict=True)),
        "sum_rc": sum(w * r * c for w, (r, c, _) in zip(weights, valid, strict=True)),
        "sum_cc": sum(w * c * c for w, (_, c, _) in zip(weights, valid, strict=True)),
        "sum_rt": sum(w * r * t for w, (r, _, t) in zip(weights, valid, strict=True)),
        "sum_ct": sum(w * c * t for w, (_, c, t) in zip(weights, valid, strict=True)),
    }
    decay = DECAY**k
    rows = ModelThroughput.objects.filter(model_id=model_id, gpu_class_id=gpu_class_id)
    decayed = {"observations": F("observations") + k, **{name: F(name) * decay + value for name, value in sums.items()}}
    if rows.update(**decayed):
        return
    try:
        with transaction.atomic():
            ModelThroughput.objects.create(model_id=model_id, gpu_class_id=gpu_class_id, observations=k, **sums)
    except IntegrityError:
        # Another shard of the same model and class created the row first: add to it.
        rows.update(**decayed)


def throughput_estimate(model: Model, gpu_class_id: int | None = None) -> CostModel:
    """The cost model of `model` on a GPU class (default: the model's own class).

    Until a shard of it has finished there: `seconds_per_record` (and `seconds_per_char`) from the
    model's default parameters when it declares them, else `BATCHERY_DEFAULT_SECONDS_PER_RECORD`
    a record and nothing a character.
    """
    class_id = model.gpu_class_id if gpu_class_id is None else gpu_class_id
    row = ModelThroughput.objects.filter(model=model, gpu_class_id=class_id, observations__gt=0).first()
    if row is not None:
        per_record, per_char = row.rates()
        return CostModel(per_record_s=per_record, per_char_s=per_char, observed=True)
    declared = model.default_params or {}
    return CostModel(
        per_record_s=_rate(declared.get("seconds_per_record"), settings.BATCHERY_DEFAULT_SECONDS_PER_RECORD),
        per_char_s=_rate(declared.get("seconds_per_char"), 0.0),
        observed=False,
    )


def _rate(value: object, default: float) -> float:
    """A declared rate when it is a finite, non-negative number; else the default."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return default
