"""Where a benchmark's time goes: py-spy attached to running processes, its samples summed into the
top entries by own time and by time under Batchery's code, and the CPU seconds of a process tree.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

if TYPE_CHECKING:
    import psutil

# Frames of Batchery's own code, for the profile's second table.
OWN_CODE = ("portal/", "tasks/", "gpuworkers/")
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>.*?)(?::\d+)?\)$")
RATE_HZ = 200


@dataclass(frozen=True)
class Profile:
    label: str
    samples: int
    by_process: list[tuple[str, int]]
    own_time: list[tuple[str, int]]
    """(function, samples in which it was the innermost frame), most first."""
    under: list[tuple[str, int]]
    """(function of Batchery's code, samples in which it was on the stack), most first."""


def _frame_name(frame: str) -> str:
    """`function (path:line)` -> `function (short path)`: lines of one function add up."""
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match["path"]
    for marker in ("site-packages/", str(settings.BASE_DIR) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match['function']} ({path})"


def _process_name(frame: str) -> str:
    """`process 12:"/venv/bin/python -m celery ... --hostname control@%h ..."` -> `celery control@%h`.

    py-spy names each process by its command line; processes of one kind (a slot's worker and its pool
    child) add up, and their names stay short."""
    words = re.sub(r"^process \d+:", "", frame).strip('"').split()
    if words and "python" in Path(words[0]).name:
        words = words[1:]
    if words[:1] == ["-m"]:
        words = words[1:]
    if "--hostname" in words[:-1]:
        return f"{words[0]} {words[words.index('--hostname') + 1]}"
    return " ".join(words[:2])


def parse_py_spy_raw(text: str, *, label: str, top: int = 12) -> Profile:
    """Top entries of py-spy's `raw` output (collapsed stacks: `frame;frame;... count` a line)."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    samples = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = stack.split(";")
        # With --subprocesses a stack begins with its process's ancestors: the innermost one was sampled.
        process = next((f for f in reversed(frames) if f.startswith("process ")), "process 0:?")
        processes[_process_name(process)] += count
        names = [_frame_name(f) for f in frames if not f.startswith(("process ", "thread "))]
        if names:
            own[names[-1]] += count
        for name in set(names):
            if any(part in name for part in OWN_CODE) and "site-packages" not in name:
                under[name] += count
    return Profile(
        label=label,
        samples=samples,
        by_process=processes.most_common(5),
        own_time=own.most_common(top),
        under=under.most_common(top),
    )


@contextmanager
def py_spy(pids: dict[str, int], output_dir: Path) -> Iterator[list[Path]]:
    """py-spy recording each pid and its children while the block runs; yields the raw files, written at the end."""
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    outputs = [output_dir / f"{name}.txt" for name in pids]
    # --gil: only threads holding the GIL, i.e. running Python: where the CPU goes, not the waits.
    options = ["--subprocesses", "--format", "raw", "--rate", str(RATE_HZ), "--nonblocking", "--gil"]
    recorders = [
        subprocess.Popen(
            [binary, "record", "--pid", str(pid), *options, "--output", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid, out in zip(pids.values(), outputs, strict=True)
    ]
    time.sleep(1)  # py-spy attaches to the children before the measured run starts
    try:
        yield outputs
    finally:
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)
        for recorder in recorders:
            try:
                recorder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                recorder.kill()


def profile_while(pids: dict[str, int], label: str, run: Callable[[], object], output_dir: Path) -> Profile:
    """`run()` with py-spy attached to each of `pids` and their children, summed into one profile."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with py_spy(pids, output_dir) as outputs:
        run()
    text = "\n".join(out.read_text() for out in outputs if out.exists())
    if not text.strip():
        raise RuntimeError("py-spy wrote no samples (is ptrace allowed here?)")
    return parse_py_spy_raw(text, label=label)


def render_profile(profile: Profile) -> list[str]:
    def share(count: int) -> str:
        return f"{count / max(profile.samples, 1):6.1%}"

    lines = [f"profile of {profile.label} ({profile.samples} samples at {RATE_HZ} Hz of threads holding the GIL)"]
    lines += [f"  {share(count)}  process {name}" for name, count in profile.by_process]
    lines.append("  own time (innermost frame):")
    lines += [f"  {share(count)}  {name}" for name, count in profile.own_time]
    lines.append("  time under, Batchery's code:")
    lines += [f"  {share(count)}  {name}" for name, count in profile.under]
    return lines


def cpu_seconds_of(process: psutil.Process) -> float:
    """User and system CPU seconds of one process; 0 where it ended since it was listed."""
    import psutil

    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds so far of a process and its living children; 0 where it has ended."""
    import psutil

    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.Error:
        return 0.0
    return sum(cpu_seconds_of(process) for process in [root, *children])


def machine_busy_seconds() -> float:
    """CPU seconds the machine's cores have spent busy since boot (user, system, interrupts, stolen); the change
    over a run, less the run's own processes' CPU, is what the rest of the machine took meanwhile."""
    import psutil

    times = psutil.cpu_times()
    fields = ("user", "nice", "system", "irq", "softirq", "steal")
    return sum(getattr(times, name, 0.0) for name in fields)
