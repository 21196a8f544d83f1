"""The catalog side of the platform benchmarks: registering a `bench.engines` model, or a vLLM model on disk.

`bench_models` stays free of Django (the GPU workers import it to run the models); the benches that
run jobs through those models register them here first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portal.catalog.models import GpuClass, Model
from portal.catalog.services import catalog_publish


def bench_model_register(*, name: str, task: str, factory: str, default_params: Mapping[str, Any]) -> Model:
    """Create or update the Python-engine model `name` (version 1) on the `cpu` class, built by the
    `bench.engines` function `factory`, and publish the catalog so that workers see it."""
    model, _ = Model.objects.update_or_create(
        name=name,
        version="1",
        defaults={
            "engine": Model.Engine.PYTHON,
            "task": task,
            "source": f"bench.engines:{factory}",
            "gpu_class": GpuClass.objects.get(name="cpu"),
            "default_params": dict(default_params),
            "is_default": False,
        },
    )
    catalog_publish()
    return model


def bench_class_model(*, name: str, gpu_class: str) -> Model:
    """A sleeping `classify` model of its own GPU class, so that a benchmark's rows are one queue's alone
    (the rows are made by hand: no worker runs it)."""
    model, _ = Model.objects.update_or_create(
        name=name,
        version="1",
        defaults={
            "engine": Model.Engine.PYTHON,
            "task": Model.Task.CLASSIFY,
            "source": "bench.engines:sleep_factory",
            "gpu_class": GpuClass.objects.get_or_create(name=gpu_class)[0],
            "is_default": False,
        },
    )
    return model


def bench_vllm_model_register(*, name: str, source: str, gpu_class: str, load_params: Mapping[str, Any]) -> Model:
    """Create or update the vllm-engine chat model `name` (version 1) of the model directory `source` on
    `gpu_class`, and publish the catalog so that workers see it."""
    model, _ = Model.objects.update_or_create(
        name=name,
        version="1",
        defaults={
            "engine": Model.Engine.VLLM,
            "task": Model.Task.CHAT,
            "source": source,
            "gpu_class": GpuClass.objects.get_or_create(name=gpu_class)[0],
            "load_params": dict(load_params),
            "default_params": {},
            "is_default": False,
        },
    )
    catalog_publish()
    return model
