"""Catalog entries (what a model is, where its weights are, where it runs), GPU classes and prices."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from gpuworkers.engines.media import MODALITIES
from gpuworkers.spec import AdapterSpec, ModelSpec
from portal.catalog.money import ZERO, validate_currency

NOT_NEGATIVE = MinValueValidator(ZERO, message="A price cannot be negative.")


def validate_matryoshka_dimensions(value: Any) -> None:
    """A list of distinct positive whole numbers, as the admin and the API must store it."""
    if not isinstance(value, list) or not all(
        isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in value
    ):
        raise ValidationError("Matryoshka dimensions must be a list of positive whole numbers, e.g. [768, 256, 64].")
    if len(set(value)) != len(value):
        raise ValidationError("Matryoshka dimensions must not repeat a size.")


def validate_input_modalities(value: Any) -> None:
    """A list of distinct kinds of input from `MODALITIES`, text among them."""
    if not isinstance(value, list) or not all(isinstance(kind, str) and kind in MODALITIES for kind in value):
        raise ValidationError(f'Input modalities must be a list of {", ".join(MODALITIES)}, e.g. ["text", "image"].')
    if "text" not in value or len(set(value)) != len(value):
        raise ValidationError("Input modalities must include text, and name each kind once.")


def text_only() -> list[str]:
    return ["text"]


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
    matryoshka_dimensions = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_matryoshka_dimensions],
        help_text=(
            "Embedding models trained with Matryoshka representation learning: the sizes trained for, the largest "
            "being the full embedding's, e.g. [768, 512, 256, 128, 64]. Requests may then ask for `dimensions` up to "
            "the largest; empty: the model's embeddings cannot be shortened."
        ),
    )
    input_modalities = models.JSONField(
        default=text_only,
        validators=[validate_input_modalities],
        help_text=(
            "Kinds of input the model takes in chat messages: text, and image, audio or video for a multimodal "
            "model. Records may carry media parts of these kinds only, inline (data: URLs) within "
            "BATCHERY_MAX_MEDIA_BYTES, or as https URLs on BATCHERY_MEDIA_ALLOWED_HOSTS."
        ),
    )
    is_default = models.BooleanField(default=False)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="unique_model_name_version")]

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def tool_parser(self) -> str | None:
        """The vLLM tool parser that reads this model's own tool-call syntax (``tool_choice`` ``auto``), if any."""
        name = self.load_params.get("tool_call_parser") if self.engine == Model.Engine.VLLM else None
        return name if isinstance(name, str) else None

    def dimensions_problem(self, dimensions: Any) -> str | None:
        """What is wrong with a request's ``dimensions`` (a shortened embedding's size) for this model; None if nothing.

        The text follows the field's name in a message, e.g. ``f"body.dimensions {problem}"``. Any size up to the
        full one is allowed, as OpenAI allows for its own Matryoshka models; the sizes trained for keep the most
        quality, as the catalog entry lists them.
        """
        if not self.matryoshka_dimensions:
            return (
                f"is not supported by model {self.name!r}: its catalog entry declares no Matryoshka training "
                "(matryoshka_dimensions), so its embeddings cannot be shortened"
            )
        full = max(self.matryoshka_dimensions)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= full:
            shown = repr(dimensions) if isinstance(dimensions, int | float | str) else type(dimensions).__name__
            return f"must be a whole number from 1 to {full}, the embedding size of model {self.name!r}, not {shown}"
        return None

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


class ModelThroughput(models.Model):
    """How fast a model runs on a GPU class, learned from its finished shards.

    A shard's compute seconds are modelled as `per_record_s * records + per_char_s * chars` (chars:
    the characters of its records' input text). The row keeps the exponentially decayed sums of the
    least-squares normal equations over the observations (records r, chars c, seconds t): each new
    shard is added with weight 1 after every earlier one is multiplied by the decay, so an upgrade or
    a new engine version shows within a few dozen shards. `portal.catalog.throughput` writes it.
    """

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="throughputs")
    gpu_class = models.ForeignKey(GpuClass, on_delete=models.CASCADE, related_name="throughputs")
    observations = models.PositiveBigIntegerField(default=0, help_text="Finished shards learned from.")
    weight = models.FloatField(default=0.0, help_text="Decayed count of the observations.")
    sum_rr = models.FloatField(default=0.0, help_text="Decayed sum of records².")
    sum_rc = models.FloatField(default=0.0, help_text="Decayed sum of records * chars.")
    sum_cc = models.FloatField(default=0.0, help_text="Decayed sum of chars².")
    sum_rt = models.FloatField(default=0.0, help_text="Decayed sum of records * seconds.")
    sum_ct = models.FloatField(default=0.0, help_text="Decayed sum of chars * seconds.")
    updated_at = models.DateTimeField(auto_now=True)

    # Below this, 1 - cos²(records, chars) says the shards seen so far all had about the same chars
    # per record (std of that ratio under ~1 %): records and chars cannot be told apart, so the
    # split between the two rates would be noise. The per-record rate alone predicts such shards.
    COLLINEAR = 1e-4

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "gpu_class"], name="unique_throughput_per_class")]

    def __str__(self) -> str:
        return f"{self.model_id} on {self.gpu_class_id}"

    def rates(self) -> tuple[float, float]:
        """(seconds per record, seconds per char): the decayed least-squares fit, never negative."""
        if self.sum_rr <= 0:
            return 0.0, 0.0
        per_record_only = max(self.sum_rt / self.sum_rr, 0.0)
        if self.sum_cc <= 0:
            return per_record_only, 0.0
        det = self.sum_rr * self.sum_cc - self.sum_rc**2
        if det <= self.COLLINEAR * self.sum_rr * self.sum_cc:
            return per_record_only, 0.0
        per_record = (self.sum_cc * self.sum_rt - self.sum_rc * self.sum_ct) / det
        per_char = (self.sum_rr * self.sum_ct - self.sum_rc * self.sum_rt) / det
        if per_record >= 0 and per_char >= 0:
            return per_record, per_char
        # The best fit with one rate held at zero: of the two one-rate fits, the one whose residual
        # is smaller, i.e. whose sum_xt² / sum_xx is larger.
        per_char_only = max(self.sum_ct / self.sum_cc, 0.0)
        if self.sum_ct * per_char_only >= self.sum_rt * per_record_only:
            return 0.0, per_char_only
        return per_record_only, 0.0


class Adapter(models.Model):
    """A LoRA adapter of a base model: a catalog entry of its own, run on slots that keep the base model warm.

    An adapter owned by a tenant is that tenant's alone; one without an owner is shared by the operators
    with every tenant allowed its base model. A job or a record names an adapter where it would name a
    model; the newest enabled version of that name runs, the tenant's own before a shared one.
    """

    ENGINES = (Model.Engine.TRANSFORMERS, Model.Engine.VLLM)
    """The engines that serve adapters on their base model."""
    TASKS = (Model.Task.GENERATE, Model.Task.CHAT)

    name = models.CharField(max_length=200)
    version = models.CharField(max_length=50, default="1")
    description = models.TextField(blank=True)
    base_model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="adapters")
    owner = models.ForeignKey(
        "tenancy.Tenant",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="adapters",
        help_text="The tenant whose adapter this is; empty: shared by the operators.",
    )
    source = models.CharField(
        max_length=500,
        help_text="Directory of adapter_config.json and adapter_model.safetensors: a local path, file:///path or "
        "s3://bucket/prefix/.",
    )
    rank = models.PositiveSmallIntegerField(help_text="The LoRA rank (r).")
    size_bytes = models.PositiveBigIntegerField(default=0, help_text="Bytes of the adapter's weights.")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "name", "version"],
                condition=models.Q(owner__isnull=False),
                name="unique_adapter_version_per_owner",
            ),
            models.UniqueConstraint(
                fields=["name", "version"], condition=models.Q(owner__isnull=True), name="unique_shared_adapter_version"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    def to_spec(self) -> AdapterSpec:
        return AdapterSpec(name=self.name, version=self.version, source=self.source, rank=self.rank)


class Price(models.Model):
    """What running a model (or one of its adapters) costs from a date on, in the deployment's currency.

    A job's ledger line is priced by the price in force on the day it was recorded (`effective_from` on
    or before it), so that a new price leaves past months' bills as they were: prices are added, not
    edited, once in force (the admin makes them read-only). Of the prices in force, one for the job's
    adapter beats one for its model, one for its GPU class beats one for any class, then the newest wins.

    Deleting never re-prices a past bill: the ledger lines a price priced keep their cost (`JobUsage.cost`,
    frozen when the line is written). Nothing deletes a price unrecorded either: its model and GPU class
    cannot be deleted while it exists (PROTECT), and an adapter, its tenant's to delete, goes through
    `adapter_delete`, which records each of its prices in the audit log as it deletes them.
    """

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="prices")
    adapter = models.ForeignKey(
        Adapter,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="prices",
        help_text="An adapter of the model priced apart; empty: the model and every adapter without its own price.",
    )
    gpu_class = models.ForeignKey(
        GpuClass,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="prices",
        help_text="Empty: any GPU class; a price for the class a job ran on beats it.",
    )
    currency = models.CharField(
        max_length=3, validators=[validate_currency], help_text="ISO 4217 code: the deployment's BATCHERY_CURRENCY."
    )
    per_gpu_second = models.DecimalField(max_digits=20, decimal_places=10, default=ZERO, validators=[NOT_NEGATIVE])
    per_million_input_tokens = models.DecimalField(
        max_digits=20, decimal_places=10, default=ZERO, validators=[NOT_NEGATIVE]
    )
    per_million_cached_input_tokens = models.DecimalField(
        max_digits=20,
        decimal_places=10,
        null=True,
        blank=True,
        validators=[NOT_NEGATIVE],
        help_text="Prompt tokens served from a shared prefix's cache; empty: the input price.",
    )
    per_million_output_tokens = models.DecimalField(
        max_digits=20, decimal_places=10, default=ZERO, validators=[NOT_NEGATIVE]
    )
    effective_from = models.DateField(help_text="The first day (UTC) of the jobs recorded at this price.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "adapter", "gpu_class", "-effective_from"]
        # One price per model, adapter (or none), GPU class (or any) and day, so that which price applies is
        # never a toss-up. Four partial constraints, not one with nulls_distinct, which SQLite lacks.
        constraints = [
            models.UniqueConstraint(
                fields=[
                    "model",
                    *(["adapter"] if adapter else []),
                    *(["gpu_class"] if gpu_class else []),
                    "effective_from",
                ],
                condition=models.Q(adapter__isnull=not adapter, gpu_class__isnull=not gpu_class),
                name=f"one_price_a_day{'_adapter' if adapter else ''}{'_class' if gpu_class else ''}",
                violation_error_message="A price for this model, adapter and GPU class from that day exists already.",
            )
            for adapter in (False, True)
            for gpu_class in (False, True)
        ]

    def __str__(self) -> str:
        target = f"{self.adapter}" if self.adapter_id else f"{self.model}"
        where = f" on {self.gpu_class}" if self.gpu_class_id else ""
        return f"{target}{where} from {self.effective_from}"

    def clean(self) -> None:
        adapter = self.adapter if self.adapter_id is not None else None
        if adapter is not None and self.model_id is not None and adapter.base_model_id != self.model_id:
            raise ValidationError({"adapter": f"{adapter} is an adapter of {adapter.base_model}, not of {self.model}."})

    @property
    def cached_input_price(self) -> Decimal:
        """Per million cached prompt tokens: its own price, or the input price where it has none."""
        cached = self.per_million_cached_input_tokens
        return self.per_million_input_tokens if cached is None else cached
