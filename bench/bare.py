"""The bare model loop, the baseline of `make bench`'s whole-stack ratio: `model.encode` over the same
sentences, weights loaded, nothing of Batchery around it.

`bare_loop_rate` runs it in this process on torch's default threads. `bare_limit_rate` is the limit the
ratio is taken against: one single-thread process per core, all at once, each encoding its share of the
sentences; the rate is all the sentences over the time from the moment every process has its model
loaded to the end of the slowest. Measured in parallel, not as one process's rate times the cores: cores
that share caches, memory bandwidth and a power budget run slower together than one runs alone.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

_WARMUP_SENTENCES = 256


def _load(source: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from sentence_transformers import SentenceTransformer

    from gpuworkers.sources import resolve_model_source

    return SentenceTransformer(str(resolve_model_source(source)), device="cpu")


def bare_loop_rate(sentences: list[str], *, source: str, batch_size: int) -> float:
    """Sentences per second of `model.encode` in this process, on torch's default threads."""
    model = _load(source)
    model.encode(sentences[:_WARMUP_SENTENCES], batch_size=batch_size, show_progress_bar=False)
    started = time.perf_counter()
    model.encode(sentences, batch_size=batch_size, show_progress_bar=False)
    return len(sentences) / (time.perf_counter() - started)


def _encode_share(sentences: list[str], source: str, batch_size: int, ready: Any, results: Any) -> None:
    import torch

    torch.set_num_threads(1)
    model = _load(source)
    model.encode(sentences[:_WARMUP_SENTENCES], batch_size=batch_size, show_progress_bar=False)
    ready.wait()
    model.encode(sentences, batch_size=batch_size, show_progress_bar=False)
    results.put(time.monotonic())


def bare_limit_rate(sentences: list[str], *, source: str, batch_size: int, processes: int) -> float:
    """Sentences per second of ``processes`` single-thread processes encoding equal shares at once."""
    # Spawned, not forked: a fork of this process would inherit its torch threads and Django connections.
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(processes + 1)
    results = context.Queue()
    shares = [sentences[n::processes] for n in range(processes)]
    children = [
        context.Process(target=_encode_share, args=(share, source, batch_size, ready, results), daemon=True)
        for share in shares
    ]
    for child in children:
        child.start()
    try:
        ready.wait(timeout=300)
        started = time.monotonic()
        ended = max(results.get(timeout=3600) for _ in children)
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    return len(sentences) / (ended - started)
