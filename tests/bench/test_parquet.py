"""The Parquet merge benchmark at a tiny size: both paths run and give the same rows."""

from __future__ import annotations

from bench.parquet import render_parquet, run_parquet_bench


def test_the_parquet_bench_merges_both_ways_and_finds_the_same_rows() -> None:
    bench = run_parquet_bench(records=2_500, shard_size=1_000)

    assert (bench.records, bench.shards) == (2_500, 3)
    assert bench.same_rows
    assert bench.old_merge_s > 0 and bench.pieces_merge_s > 0 and bench.pieces_write_s > 0
    assert "merge from the pieces" in render_parquet(bench)
