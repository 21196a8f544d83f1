"""The commands `portal.devstack.stack` starts the slots with, built without starting anything."""

from __future__ import annotations

import pytest

from portal.devstack.stack import Stack, StackOptions


def _launch_command(options: StackOptions, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    stack = Stack(options)
    commands: dict[str, list[str]] = {}
    monkeypatch.setattr(stack, "_spawn", lambda name, command, *args, **kwargs: commands.setdefault(name, command))
    stack._spawn_workers()
    return commands["gpuworkers"]


@pytest.mark.parametrize(
    ("options", "expected", "absent"),
    [
        (StackOptions(gpus="0"), ["--gpus", "0"], "--cpu-slots"),
        (StackOptions(cpu_slots=1), ["--cpu-slots", "1"], "--gpus"),
    ],
)
def test_the_launcher_gets_the_stacks_gpus_or_its_cpu_slots(
    monkeypatch: pytest.MonkeyPatch, options: StackOptions, expected: list[str], absent: str
) -> None:
    command = _launch_command(options, monkeypatch)

    start = command.index(expected[0])
    assert command[start : start + 2] == expected
    assert absent not in command
