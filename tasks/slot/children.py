"""A slot's pool process may start processes of its own: vLLM's engine core and workers on a GPU host, and the
grammar gate's compiler (`gpuworkers.engines.grammar_gate`).

A pool process is billiard's, which multiprocessing takes for its own current process: daemonic, which
multiprocessing refuses any child ("daemonic processes are not allowed to have children"), and with billiard's
authentication key, which multiprocessing's spawn cannot pickle ("Pickling an AuthenticationString object is
disallowed"). The slot's process sets both as a process of multiprocessing's own would have them when it
starts, before a preloaded model loads. Its children do not outlive it: vLLM's watch their parent, and the
compiler ends when its pipe closes.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
from typing import Any

from celery.signals import worker_process_init


@worker_process_init.connect
def allow_children(**_: Any) -> None:
    process = multiprocessing.current_process()
    process.daemon = False
    # Billiard's setter would wrap the key in its own class again.
    process._config["authkey"] = multiprocessing.process.AuthenticationString(os.urandom(32))  # type: ignore[attr-defined]
