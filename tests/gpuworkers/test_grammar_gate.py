"""A schema's compile time on a shared vLLM slot is bounded: compiled once in the slot's own compiler process
within BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S, refused (its record alone) where it does not finish or compile,
and the verdict remembered. xgrammar comes with vLLM and is absent here: a stand-in compiler stands for it
(`tests.support.grammar_compilers`), run in the real process the gate starts."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuworkers.batching import Item, run_records
from gpuworkers.engines.grammar_gate import GrammarGate
from gpuworkers.engines.sampling import SchemaRefused
from tests.gpuworkers.test_vllm_engine import fake_vllm, loaded  # noqa: F401 (fake_vllm: a fixture)
from tests.support.grammar_compilers import STANDIN
from tests.support.vllm_standins import vllm_spec

FOREVER = {"title": "compiles-forever", "type": "object"}
BROKEN = {"title": "does-not-compile", "type": "object"}
FINE = {"title": "fine", "type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[GrammarGate]:
    monkeypatch.setenv("BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S", "1")
    opened = GrammarGate(tokenizer_path=str(tmp_path), compiler_path=STANDIN)
    yield opened
    opened.close()


def _compilers() -> list[psutil.Process]:
    """This process's live spawned children (multiprocessing's resource tracker aside)."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_schema_that_compiles_for_ever_is_refused_at_the_bound_and_its_compiler_stopped(gate: GrammarGate) -> None:
    gate.check("response_format", FINE)
    [compiler] = _compilers()

    started = time.monotonic()
    with pytest.raises(SchemaRefused) as refused:
        gate.check("response_format", FOREVER)
    took = time.monotonic() - started

    assert took < 5, took
    assert refused.value.field == "response_format"
    assert "within 1 s" in str(refused.value) and "BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S" in str(refused.value)
    assert not compiler.is_running() or compiler.status() == "zombie"
    # The verdict is remembered: asked again (the record alone, after its micro-batch failed), no wait.
    started = time.monotonic()
    with pytest.raises(SchemaRefused):
        gate.check("response_format", FOREVER)
    assert time.monotonic() - started < 0.1
    # The next schema gets a compiler again.
    gate.check("response_format", {**FINE, "title": "another"})
    assert len(_compilers()) == 1


def test_a_schema_that_does_not_compile_is_refused_with_the_compilers_error(gate: GrammarGate) -> None:
    with pytest.raises(SchemaRefused, match="does not compile into a grammar: ValueError: unsupported keyword"):
        gate.check("response_format", BROKEN)


def test_a_schema_is_compiled_once_whatever_its_keys_order(gate: GrammarGate, monkeypatch: pytest.MonkeyPatch) -> None:
    gate.check("response_format", FINE)
    sent: list[Any] = []
    monkeypatch.setattr(gate, "_compile", lambda text: sent.append(text))
    gate.check("response_format", dict(reversed(list(FINE.items()))))
    assert sent == []


def test_on_a_slot_a_record_whose_schema_compiles_for_ever_errors_alone_and_the_others_run(
    fake_vllm: types.ModuleType,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S", "1")
    engine, llm = loaded(vllm_spec(tmp_path, task="chat"))
    hi = [{"role": "user", "content": "hi"}]

    def held_to(schema: dict[str, Any]) -> dict[str, Any]:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}

    items = [Item("plain", hi), Item("forever", hi, held_to(FOREVER)), Item("fine", hi, held_to(FINE))]

    started = time.monotonic()
    results = {result.custom_id: result for result in run_records(engine, items, params={}, micro_batch_size=8)}

    assert time.monotonic() - started < 10
    assert results["plain"].response is not None and results["fine"].response is not None
    error = results["forever"].error
    assert error is not None and "BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S" in error["message"]
    given = [params.kwargs.get("structured_outputs") for call in llm.calls for params in call[2]]
    assert ("structured", {"json": FINE}) in given and ("structured", {"json": FOREVER}) not in given
    engine.unload()
    assert _compilers() == []
