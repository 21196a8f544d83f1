"""The Parquet output of an embedding job, merged both ways in one run: from the JSONL, and from pieces.

The shards' outputs are made once, as `run_shard` makes them: each shard's JSONL lines printed by
orjson from float32 arrays, and its Parquet piece written from the same arrays by `ShardPiece`
(timed: the shard's extra cost). Then the job's Parquet output is built twice from those files:
the old way, `jsonl_to_parquet` over the stitched JSONL (every float parsed back), and the new way,
`merge_pieces` over the pieces in shard order. Both files must hold the same schema and rows.

Stitching the JSONL output itself is left out: the merge does it the same way on both paths.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import orjson
import pyarrow.parquet as pq

from gpuworkers.batching import RecordResult
from tasks.shared.formats.parquet_output import jsonl_to_parquet
from tasks.shared.formats.parquet_pieces import PieceSource, merge_pieces
from tasks.shared.storage import store_for
from tasks.slot.shard_piece import ShardPiece

DIM = 384
"""The bundled model's embedding length."""
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


@dataclass(frozen=True)
class ParquetBench:
    records: int
    shards: int
    jsonl_bytes: int
    parquet_bytes: int
    old_merge_s: float
    """`jsonl_to_parquet` over the stitched JSONL."""
    pieces_merge_s: float
    """`merge_pieces` over the shards' pieces."""
    pieces_write_s: float
    """The shards' extra time writing their pieces, all shards together."""
    same_rows: bool
    """Both files hold the same schema and rows."""


def run_parquet_bench(*, records: int, shard_size: int = 1_000, seed: int = 5) -> ParquetBench:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="bench-parquet-") as folder:
        root = Path(folder)
        stitched = root / "output.jsonl"
        pieces: list[str] = []
        write_s = 0.0
        with stitched.open("wb") as output:
            for index, start in enumerate(range(0, records, shard_size)):
                count = min(shard_size, records - start)
                matrix = rng.standard_normal((count, DIM), dtype=np.float32)
                results = [
                    RecordResult(f"rec-{start + n}", {"embedding": matrix[n], "usage": {"prompt_tokens": 9}}, None)
                    for n in range(count)
                ]
                lines = [
                    orjson.dumps({"custom_id": r.custom_id, "response": r.response}, option=JSON_OPTIONS)
                    for r in results
                ]
                output.writelines(lines)
                uri = (root / f"{index:05d}.output.parquet").as_uri()
                started = time.perf_counter()
                with ShardPiece(store_for(uri), uri, task="embed") as piece:
                    for line, result in zip(lines, results, strict=True):
                        piece.add(line, result)
                write_s += time.perf_counter() - started
                pieces.append(uri)

        started = time.perf_counter()
        with stitched.open("rb") as lines_in, (root / "old.parquet").open("wb") as out:
            jsonl_to_parquet(lines_in, out, task="embed")
        old_s = time.perf_counter() - started

        started = time.perf_counter()
        sources = [PieceSource(piece=_opener(uri)) for uri in pieces]
        with (root / "new.parquet").open("wb") as out:
            merge_pieces(sources, out, task="embed")
        new_s = time.perf_counter() - started

        old, new = pq.read_table(root / "old.parquet"), pq.read_table(root / "new.parquet")
        return ParquetBench(
            records=records,
            shards=len(pieces),
            jsonl_bytes=stitched.stat().st_size,
            parquet_bytes=(root / "old.parquet").stat().st_size,
            old_merge_s=old_s,
            pieces_merge_s=new_s,
            pieces_write_s=write_s,
            same_rows=old.schema == new.schema and old.equals(new),
        )


def _opener(uri: str) -> Callable[[], BinaryIO]:
    return lambda: store_for(uri).open_read(uri)


def render_parquet(bench: ParquetBench) -> str:
    per_thousand = bench.pieces_write_s / bench.records * 1000
    return "\n".join(
        [
            f"parquet output: {bench.records:,} embeddings of {DIM} floats in {bench.shards} shards "
            f"(JSONL {bench.jsonl_bytes / 1e6:.0f} MB, Parquet {bench.parquet_bytes / 1e6:.0f} MB)",
            f"  merge from the JSONL     {bench.old_merge_s:8.2f} s",
            f"  merge from the pieces    {bench.pieces_merge_s:8.2f} s   "
            f"({bench.old_merge_s / bench.pieces_merge_s:.1f}x faster)",
            f"  shards writing pieces    {bench.pieces_write_s:8.2f} s in all, {per_thousand * 1000:.1f} ms "
            "a 1,000 records (spread over the slots)",
            f"  same schema and rows     {'yes' if bench.same_rows else 'NO'}",
            "rerun: python manage.py bench --only-io --io-sizes-mb 1 --parquet-records 100000",
        ]
    )
