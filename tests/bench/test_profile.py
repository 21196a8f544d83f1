"""The benchmarks' profiles: py-spy's collapsed stacks summed into top entries, and a process tree's CPU."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
from django.conf import settings

from bench.py_spy import parse_py_spy_raw, render_profile, tree_cpu_seconds

BASE = settings.BASE_DIR


def _raw() -> str:
    site = "/venv/lib/python3.11/site-packages"
    master = 'process 10:"/venv/bin/python -m gunicorn portal.wsgi --bind 127.0.0.1:8000 --workers 4"'
    slot = 'process 20:"/venv/bin/python -m tasks.slot.worker worker --queues gpu.cpu --hostname slot1-cpu@vm"'
    return "\n".join(
        [
            # With --subprocesses a worker's stacks begin with its parent, then the worker itself.
            f"{master};{master.replace('10:', '11:')};thread (0x1);handle ({site}/gunicorn/workers/sync.py:120);"
            f"job_list ({BASE}/portal/api/views.py:40);execute ({site}/django/db/backends/utils.py:90) 30",
            f"{master};{master.replace('10:', '12:')};thread (0x1);handle ({site}/gunicorn/workers/sync.py:120);"
            f"job_list ({BASE}/portal/api/views.py:41) 10",
            f"{slot};thread (0x1);handle ({site}/celery/worker.py:121);"
            f"authenticate ({BASE}/portal/tenancy/auth.py:12);execute ({site}/django/db/backends/utils.py:91) 20",
            "not a stack line",
        ]
    )


def test_samples_add_up_by_innermost_frame_and_by_process() -> None:
    profile = parse_py_spy_raw(_raw(), label="the API")

    assert profile.samples == 60
    # Lines of one function add up; paths are shortened to the package or the repository.
    assert profile.own_time == [
        ("execute (django/db/backends/utils.py)", 50),
        ("job_list (portal/api/views.py)", 10),
    ]
    # Each sample counts for the process it was taken in, named short: workers of one kind add up.
    assert profile.by_process == [("gunicorn portal.wsgi", 40), ("tasks.slot.worker slot1-cpu@vm", 20)]


def test_time_under_counts_only_batcherys_own_frames_once_a_sample() -> None:
    profile = parse_py_spy_raw(_raw(), label="the API")

    assert profile.under == [
        ("job_list (portal/api/views.py)", 40),
        ("authenticate (portal/tenancy/auth.py)", 20),
    ]


def test_the_rendered_profile_shows_shares_of_the_samples() -> None:
    lines = render_profile(parse_py_spy_raw(_raw(), label="the API"))

    assert lines[0] == "profile of the API (60 samples at 200 Hz of threads holding the GIL)"
    assert "   83.3%  execute (django/db/backends/utils.py)" in lines
    assert "   66.7%  job_list (portal/api/views.py)" in lines


def test_a_process_trees_cpu_counts_its_children_and_is_zero_once_it_ended() -> None:
    burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"]
    )
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(parent.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        # The parent only waits: most of the tree's CPU is its child's.
        assert tree_cpu_seconds(parent.pid) >= 0.6
    finally:
        for process in [*psutil.Process(parent.pid).children(recursive=True), psutil.Process(parent.pid)]:
            process.kill()
        parent.wait()
    assert tree_cpu_seconds(parent.pid) == 0.0
