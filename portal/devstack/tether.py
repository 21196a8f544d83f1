"""Tie a child process's life to this one: where this process dies, even by SIGKILL, the kernel sends
the child a signal (Linux's PR_SET_PDEATHSIG), so the parts of `manage.py up`, each in a session of its
own, never outlive it (a Flower left behind held its port, and the next stack failed to start).

Elsewhere than Linux there is no such call: the child is not tied, and `Stack.stop` remains the way out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl: Callable[..., int] = libc.prctl
    return prctl


_PRCTL = _prctl()  # loaded here, not between fork and exec, where only async-signal-safe work belongs


def dies_with_this_process(signum: signal.Signals) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `signum` when this process dies; None where the
    platform cannot, or off the main thread (the kernel sends the signal when the thread that started the
    child ends, which for another thread may be long before the process)."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = _PRCTL, os.getpid()

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        # This process may have died between the fork and the call: then nobody would ever send it.
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return tie
