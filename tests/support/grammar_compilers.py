"""A stand-in for xgrammar's compiler in the grammar gate's process (`gpuworkers.engines.grammar_gate`), where
vLLM and xgrammar are not installed: it compiles at once, but never returns for a schema titled
``compiles-forever`` and raises for one titled ``does-not-compile``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

STANDIN = "tests.support.grammar_compilers:standin_compiler"


def standin_compiler(tokenizer_path: str) -> Callable[[str], None]:
    def compile_schema(schema: str) -> None:
        title = json.loads(schema).get("title")
        if title == "compiles-forever":
            time.sleep(3600)
        if title == "does-not-compile":
            raise ValueError("unsupported keyword 'x-nope'")

    return compile_schema
