"""Catalog entries (what a model is, where its weights are, where it runs) and GPU classes."""

from __future__ import annotations

from django.db import models

from gpuworkers.spec import ModelSpec


class GpuClass(models.Model):
    """A kind of accelerator; each has its own queue (`gpu.<name>`). `cpu` stands in where there is none."""

    name = models.SlugField(max_length=50, unique=True)
    description = models.CharField(max_length=200, blank=True)
    memory_gb = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "GPU classes"

    def __str__(self) -> str:
        return self.name


class Model(models.Model):
    class Engine(models.TextChoices):
        SENTENCE_TRANSFORMERS = "sentence_transformers"
        TRANSFORMERS = "transformers"
        VLLM = "vllm"
        PYTHON = "python"

    class Task(models.TextChoices):
        GENERATE = "generate"
        CHAT = "chat"
        EMBED = "embed"
        CLASSIFY = "classify"

    name = models.CharField(max_length=200)
    version = models.CharField(max_length=50, default="1")
    description = models.TextField(blank=True)
    engine = models.CharField(max_length=30, choices=Engine.choices)
    task = models.CharField(max_length=20, choices=Task.choices)
    source = models.CharField(
        max_length=500, help_text="Local path, file:///path, s3://bucket/prefix, or package:NAME that ships weights."
    )
    gpu_class = models.ForeignKey(GpuClass, on_delete=models.PROTECT, related_name="models")
    gpus_per_replica = models.PositiveSmallIntegerField(default=1)
    load_params = models.JSONField(default=dict, blank=True, help_text="Engine arguments used at load time.")
    default_params = models.JSONField(default=dict, blank=True, help_text="Run-time parameters jobs start from.")
    is_default = models.BooleanField(default=False)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="unique_model_name_version")]

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    def to_spec(self) -> ModelSpec:
        return ModelSpec(
            name=self.name,
            version=self.version,
            engine=self.engine,
            task=self.task,
            source=self.source,
            gpus_per_replica=self.gpus_per_replica,
            load_params=dict(self.load_params),
        )
