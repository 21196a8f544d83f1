"""Figures of an embedding re-run: each record's cosine similarity between its old and new vector, the
records that moved most, and how a sample's nearest neighbours changed.

A response's vector is its `embedding` (or `data[0].embedding`, OpenAI's shape). A record of several
inputs (`embeddings`) is not compared (`not_compared` in the report), nor one whose vectors differ in
length (a re-run with other `dimensions`: cosine needs one space).

Nearest neighbours: `sample` records drawn (seeded, so a report computed again is the same) from the pool
of compared records kept in memory; for each, its `k` nearest other records of the pool by cosine under
the old vectors and under the new ones. `overlap@k` of a record is the neighbours it keeps over k
(|old & new| / k); the report gives its mean and distribution. Memory: the pool holds both vectors of each
of its records as float32, 2 * 4 * dimensions bytes a record (6 KiB at 768 dimensions), up to
`max_vector_bytes` in all: records past that are compared by cosine but searched for no neighbours
(`neighbours.pool` says how many were). The search costs `sample` * pool * dimensions multiplications.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from portal.jobs.comparison.figures import MostChanged, distribution
from portal.jobs.comparison.pairs import Pair

COSINE_EDGES = [-1.0, 0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0]
"""Fixed bins, narrow near 1, where a re-run's vectors of one model family fall."""
OVERLAP_EDGES = [index / 10 for index in range(11)]
SEED = 0
"""The neighbour sample's seed: the same records are sampled each time a report is computed."""


def response_vector(response: dict[str, Any]) -> np.ndarray | None:
    """The one vector of an embedding response, as float64; None for a record of several inputs or none."""
    vector = response.get("embedding")
    data = response.get("data")
    if vector is None and isinstance(data, list) and len(data) == 1 and isinstance(data[0], dict):
        vector = data[0].get("embedding")
    if not isinstance(vector, list) or not vector:
        return None
    return np.asarray(vector, dtype=np.float64)


def _unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm else vector


class EmbeddingComparison:
    """Takes the records that succeeded on both sides (`add`), one at a time; `figures` reports them.
    `records` is how many records the job has at most, to size the neighbour pool once."""

    def __init__(self, *, records: int, most_changed: int, sample: int, k: int, max_vector_bytes: int) -> None:
        self._records = records
        self._sample = sample
        self._k = k
        self._max_vector_bytes = max_vector_bytes
        self._cosines = array("d")
        """Each record's cosine, 8 bytes a record, for the percentiles."""
        self._most = MostChanged(most_changed)
        self._old: np.ndarray | None = None
        self._new: np.ndarray | None = None
        self._ids: list[str] = []
        self.not_compared = 0

    def add(self, pair: Pair) -> None:
        old, new = response_vector(pair.old["response"]), response_vector(pair.new["response"])
        if old is None or new is None or old.shape != new.shape:
            self.not_compared += 1
            return
        old, new = _unit(old), _unit(new)
        # Rounding can put two equal unit vectors' product a hair past 1, out of the histogram's range.
        cosine = float(np.clip(old @ new, -1.0, 1.0))
        self._cosines.append(cosine)
        self._most.offer(-cosine, {"custom_id": pair.custom_id, "cosine": cosine})
        self._keep(pair.custom_id, old, new)

    def _keep(self, custom_id: str, old: np.ndarray, new: np.ndarray) -> None:
        if self._old is None:
            rows = min(self._records, self._max_vector_bytes // (2 * 4 * old.size))
            self._old = np.empty((rows, old.size), dtype=np.float32)
            self._new = np.empty((rows, old.size), dtype=np.float32)
        assert self._new is not None
        row = len(self._ids)
        if row < len(self._old) and old.size == self._old.shape[1]:
            self._old[row], self._new[row] = old, new
            self._ids.append(custom_id)

    def figures(self) -> dict[str, Any]:
        """`cosine` (the distribution of each record's old-new cosine similarity, `figures.distribution`),
        `least_similar` (the records of the lowest cosine, lowest first) and `neighbours` (see the module's
        doc: `k`, `pool`, `sample`, `mean_overlap`, `overlap`, the distribution of overlap@k)."""
        return {
            "cosine": distribution(self._cosines, edges=COSINE_EDGES),
            "least_similar": self._most.entries(),
            "neighbours": self._neighbours(),
        }

    def _neighbours(self) -> dict[str, Any]:
        pool = len(self._ids)
        k = min(self._k, pool - 1)
        if self._old is None or self._new is None or k < 1:
            return {"k": self._k, "pool": pool, "sample": 0, "mean_overlap": None, "overlap": None}
        old, new = self._old[:pool], self._new[:pool]
        queries = sample_rows(pool, self._sample)
        overlaps = [len(nearest(old, row, k) & nearest(new, row, k)) / k for row in queries.tolist()]
        return {
            "k": k,
            "pool": pool,
            "sample": len(queries),
            "mean_overlap": float(np.mean(overlaps)),
            "overlap": distribution(overlaps, edges=OVERLAP_EDGES),
        }


def sample_rows(pool: int, sample: int) -> np.ndarray:
    """The rows of the pool whose neighbours are compared: all of them when they are no more than `sample`,
    else `sample` drawn without replacement with `SEED`, in row order."""
    if pool <= sample:
        return np.arange(pool)
    return np.sort(np.random.default_rng(SEED).choice(pool, size=sample, replace=False))


def nearest(vectors: np.ndarray, row: int, k: int) -> set[int]:
    """The rows of the `k` unit vectors most similar to row `row`'s, itself left out."""
    similarity = vectors @ vectors[row]
    similarity[row] = -np.inf
    return {int(index) for index in np.argpartition(-similarity, k - 1)[:k]}
