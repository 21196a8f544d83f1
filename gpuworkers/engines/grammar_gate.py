"""A bound on the time a request's JSON schema may take to compile into a grammar on a shared vLLM slot.

vLLM compiles each distinct schema (a ``response_format``'s, or the tools' a reply is held to) in a thread
pool, with no timeout in it nor in its grammar backends: one schema that compiles for minutes holds every
record of the slot behind it, other tenants' included. `check_schema_bounds` bounds a schema's size; the
`GrammarGate` bounds its compile time: before a schema first reaches vLLM, a compiler process of the slot's own
compiles it once within ``BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S``. One that does not finish in time (the process
is killed, and started again for the next) or does not compile is refused, naming the bound or the error, and
the verdict is remembered by the schema's digest, as is a schema that compiled, so a shard's records each
asking for the same schema pay for one compile.

The compiler is vLLM's default backend, xgrammar, built for the model's tokenizer (`xgrammar_compiler`); the
process imports it, not the slot, so that a compile that never returns costs a process, not the slot.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import multiprocessing
from collections import OrderedDict
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from gpuworkers.engines.sampling import SchemaRefused
from tasks.shared.config import GRAMMAR_COMPILE_TIMEOUT_S

logger = logging.getLogger(__name__)

XGRAMMAR = "gpuworkers.engines.grammar_gate:xgrammar_compiler"
REMEMBERED = 1024
"""Schemas whose verdict a slot keeps (by digest), the oldest forgotten first."""
_START_S = 120.0
"""How long the compiler process may take to start (imports, the tokenizer's vocabulary), apart from the
bound on one compile."""


def xgrammar_compiler(tokenizer_path: str) -> Callable[[str], object]:
    """Compiles a JSON schema (as text) for the model at `tokenizer_path` as vLLM's xgrammar backend does under
    the engine's compact JSON (``disable_any_whitespace``)."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer), max_threads=1)
    return lambda schema: compiler.compile_json_schema(schema, any_whitespace=False)


def _serve(connection: Connection, compiler_path: str, tokenizer_path: str) -> None:
    """The compiler process: compiles each schema it is sent, and answers None or the error's message."""
    module, _, name = compiler_path.partition(":")
    compile_schema = getattr(importlib.import_module(module), name)(tokenizer_path)
    connection.send(None)
    while True:
        try:
            schema = connection.recv()
        except EOFError:  # the slot closed its end: its engine unloaded
            return
        try:
            compile_schema(schema)
        except Exception as exc:
            connection.send(f"{type(exc).__name__}: {exc}"[:300])
        else:
            connection.send(None)


class GrammarGate:
    """Lets a schema through to vLLM once it has compiled within the bound (see the module)."""

    def __init__(self, *, tokenizer_path: str, compiler_path: str | None = None) -> None:
        self._tokenizer_path = tokenizer_path
        self._compiler_path = compiler_path or XGRAMMAR
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._process: Any = None
        self._connection: Connection | None = None

    def check(self, field: str, schema: Mapping[str, Any]) -> None:
        """Raise `SchemaRefused` naming `field` where `schema` does not compile within the bound."""
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in self._verdicts:
            self._verdicts.move_to_end(digest)
        else:
            self._verdicts[digest] = self._compile(text)
            if len(self._verdicts) > REMEMBERED:
                self._verdicts.popitem(last=False)
        refusal = self._verdicts[digest]
        if refusal is not None:
            raise SchemaRefused(field, f"the JSON schema the reply is held to ({field}'s or the tools') {refusal}")

    def close(self) -> None:
        """Stop the compiler process (the engine's unload)."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = self._connection = None

    def _compile(self, text: str) -> str | None:
        """None where `text` compiled in time; else why not, for the refusal."""
        timeout = GRAMMAR_COMPILE_TIMEOUT_S.read()
        connection = self._started()
        connection.send(text)
        if not connection.poll(timeout):
            logger.warning("a JSON schema did not compile within %.1f s; its compiler process is stopped", timeout)
            self.close()
            return (
                f"does not compile into a grammar within {timeout:g} s, this platform's limit "
                "(BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S)"
            )
        error: str | None = connection.recv()
        return None if error is None else f"does not compile into a grammar: {error}"

    def _started(self) -> Connection:
        if self._connection is not None and self._process is not None and self._process.is_alive():
            return self._connection
        self.close()
        # Spawned, not forked: the slot holds threads (torch's, vLLM's) a fork would copy in any state.
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_serve, args=(theirs, self._compiler_path, self._tokenizer_path), name="grammar-gate", daemon=True
        )
        process.start()
        theirs.close()
        try:
            if not ours.poll(_START_S):
                raise TimeoutError(f"it did not start within {_START_S:g} s")
            ours.recv()
        except (EOFError, OSError) as exc:
            process.kill()
            process.join()
            raise RuntimeError(
                f"the grammar compiler ({self._compiler_path}) could not start: {type(exc).__name__}: {exc}; "
                "see the slot's log"
            ) from None
        self._process, self._connection = process, ours
        return ours
