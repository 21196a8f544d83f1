"""The prefix reuse benchmark at a tiny size: both passes run, give the same completions, and reuse computes less."""

from __future__ import annotations

from bench.prefix import render_prefix, run_prefix_bench


def test_the_prefix_bench_runs_reuse_off_and_on_with_the_same_completions_and_fewer_tokens_computed() -> None:
    bench = run_prefix_bench(lines=60, variants=3, system_tokens=200, shard_size=40)

    assert (bench.lines, bench.shards) == (60, 2)
    assert bench.same_outputs
    assert bench.off.cached_tokens == 0 and bench.off.computed_tokens == bench.off.prompt_tokens
    assert bench.on.prompt_tokens == bench.off.prompt_tokens
    assert bench.on.computed_tokens * 3 < bench.off.computed_tokens
    assert "prompt tokens computed" in render_prefix(bench)
