"""Dry run: what a submission would do, without doing it.

`job_dry_run` takes the request `job_submit` takes and checks it with the same code (`request_checks.py`),
reads the input as the planner will (`plan.py`: the same records, the same shard cuts), counts its
tokens with the model's own tokenizer (`portal.catalog.tokenizers`), estimates its cost and when it
would end behind the work already on its GPU queue, and holds it against the tenant's quota.

It stores nothing: no job row, no shard file, no broker message; the quota row is read, neither
locked nor created.

It runs inside a web request, so it reads at most a prefix of the input: no more than
BATCHERY_DRY_RUN_MAX_RECORDS valid records, BATCHERY_DRY_RUN_MAX_BYTES of the input as stored and
BATCHERY_DRY_RUN_MAX_SECONDS, whichever ends first (the reads themselves are counted and timed, so an
input of over-long lines or a slow decompression stops too). An input read whole gives exact figures,
as before. One cut short is `sampled`: the report says how much was read and on what basis its
figures for the whole input (`estimated_records`, `estimated_input_tokens`, the shard count, the
seconds, the ETA) were extrapolated, while its lines, problems and tokens cover the prefix read.
"""

from __future__ import annotations

import math
import statistics
import uuid
from array import array
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from typing import IO, Any, cast

from django.conf import settings
from django.db.models import F, FloatField, Sum
from django.db.models.functions import Coalesce

from portal.catalog.tokenizers import TokenCounter, token_counter
from portal.execution.capacity import queue_slots
from portal.execution.dispatch import job_queue
from portal.execution.plan import job_records
from portal.execution.plan_grouped import grouped_cut
from portal.execution.prefix_groups import prefix_key_for
from portal.execution.shard_cut import CutShard, ShardCut, ShardCutter, record_chars
from portal.jobs.adapters import JobAdapters
from portal.jobs.budget import BudgetLine, budget_line
from portal.jobs.cost_estimate import GENERATING, CostEstimate, OutputCaps, cost_estimate
from portal.jobs.models import SCHEDULABLE, UNSETTLED, Job, Shard
from portal.jobs.quota import QuotaLine, input_limits, quota_lines, quota_usage
from portal.jobs.record_checks import record_checks
from portal.jobs.requests import JobRequest
from portal.jobs.selectors import queue_jobs
from portal.jobs.services.dry_run_budget import MeteredPosition, SampleBudget, SampleEnds
from portal.jobs.services.request_checks import InputCheck, input_errors, input_rejected, submission_request
from portal.tenancy.models import Quota, Tenant
from tasks.shared.formats.compression import DecompressionLimits
from tasks.shared.formats.jsonl import JsonlCheck
from tasks.shared.formats.records import LineProblem, Record
from tasks.shared.storage import store_for

MAX_LISTED_SHARDS = 100
"""Up to this many shards the report lists each; past it, only their count and spread."""
TOKEN_BATCH = 256
"""Records tokenized in one call: fast tokenizers work through a batch in parallel."""


@dataclass(frozen=True)
class ShardEstimate:
    records: int
    seconds: float
    """Estimated compute seconds on one replica."""


@dataclass(frozen=True)
class ShardPlan:
    """The shards the planner would cut: each of them, or for many only their spread."""

    count: int
    listed: tuple[ShardEstimate, ...]
    """Every shard in input order while there are at most MAX_LISTED_SHARDS; else empty."""
    min_records: int
    median_records: float
    max_records: int
    min_seconds: float
    median_seconds: float
    max_seconds: float

    @classmethod
    def of(cls, cuts: Sequence[CutShard]) -> ShardPlan:
        records = [cut.record_count for cut in cuts] or [0]
        seconds = [cut.estimated_seconds for cut in cuts] or [0.0]
        listed = [ShardEstimate(records=cut.record_count, seconds=cut.estimated_seconds) for cut in cuts]
        return cls(
            count=len(cuts),
            listed=tuple(listed) if len(cuts) <= MAX_LISTED_SHARDS else (),
            min_records=min(records),
            median_records=statistics.median(records),
            max_records=max(records),
            min_seconds=min(seconds),
            median_seconds=statistics.median(seconds),
            max_seconds=max(seconds),
        )


@dataclass(frozen=True)
class OverLength:
    """Records with more tokens than the model reads from one input."""

    max_tokens: int
    """The model's maximum input length (`TokenCounter.max_tokens`)."""
    count: int
    lines: tuple[int, ...]
    """1-based line (row) numbers of the first BATCHERY_MAX_REPORTED_PROBLEMS of them."""


@dataclass(frozen=True)
class PrefixGroups:
    """How the planner would keep together the records whose prompts begin alike
    (`portal.execution.prefix_groups`): each group's records in shards of their own."""

    groups: int
    records: int
    """Records read that fall in a group; the others would be planned among the ungrouped ones."""


@dataclass(frozen=True)
class DryRunSample:
    """How much of the input a sampled dry run read, and how it extrapolated to the whole input."""

    records: int
    """Valid records read."""
    input_bytes_read: int
    """Bytes of the input as stored (compressed, if it is) read, read-ahead included."""
    stopped_by: str
    """The setting whose limit ended the reading: BATCHERY_DRY_RUN_MAX_RECORDS, _BYTES or _SECONDS."""
    basis: str
    """"records": the whole input's records were counted first (as a submission counts a small input),
    and the estimates scale by them; "bytes": by the input's size over the bytes read; "none": neither
    was known, and the estimates are the prefix's own."""
    scale: float
    """The whole input over the prefix read, by `basis`: what the prefix's figures are multiplied by."""


@dataclass(frozen=True)
class DryRunReport:
    """What submitting the request would do. Seconds are estimates from the model's throughput."""

    model: str
    """The model the request resolves to, `name@version` (an adapter's base model)."""
    adapters: tuple[str, ...]
    """The LoRA adapters the job would run, `name@version`: the one it names, and those its records read so far name."""
    input_bytes: int
    unit: str
    """What records are numbered by: "line", or "row" for Parquet."""
    sampled: bool
    """True: only a prefix of the input was read (`sample`); records, problems and tokens are the
    prefix's, and the figures named estimated, the shard count and the ETA extrapolated to the whole."""
    sample: DryRunSample | None
    records: int
    """Valid records read: all of them unless `sampled`."""
    estimated_records: int
    """Valid records of the whole input: `records` unless `sampled`, else extrapolated (`sample`)."""
    problem_count: int
    problems: tuple[LineProblem, ...]
    """The first BATCHERY_MAX_REPORTED_PROBLEMS bad lines, with the messages a submission gives."""
    rejected: str | None
    """The refusal `job_submit` would raise for the input's lines; None: the lines are fine."""
    input_tokens: int | None
    """Tokens of the valid records' inputs read, by the model's tokenizer; None: the engine has none."""
    estimated_input_tokens: int | None
    """Tokens of the whole input: `input_tokens` unless `sampled`, else extrapolated."""
    over_length: OverLength | None
    """None where tokens are not counted or the model's maximum is not known."""
    prefix_groups: PrefixGroups | None
    """None: the job would be planned ungrouped (no prompt beginning shared widely enough, a task that
    does not generate, or prefix reuse turned off). Sampled: the groups of the records read."""
    shards: ShardPlan
    """Sampled: `count` is extrapolated, the spread is that of the prefix's shards, none is listed.
    Grouped (`prefix_groups`): the shards of each group and of the ungrouped records, in the order the
    planner opens them."""
    estimated_seconds: float
    """Compute seconds of every shard on one replica."""
    estimated_gpu_seconds: float
    """`estimated_seconds` times the model's GPUs per replica: what usage and fair share charge."""
    observed: bool
    """True: the estimate is learned from the model's finished shards; False: a default rate."""
    queue: str
    slots: int
    """Slots consuming the queue (`queue_slots`): its live slots, or the default window's."""
    backlog_seconds: float
    """Estimated seconds of the shards waiting or running on the queue, every tenant's."""
    share: float
    """The tenant's fraction of the queue while other tenants have work on it."""
    eta_seconds: float
    """Seconds from submission to the last shard's end; see `eta_seconds`."""
    quota: tuple[QuotaLine, ...]
    """Each limit of the tenant's quota that is set, held against this job."""
    cost: CostEstimate
    """The bounds of the job's cost at today's prices (`portal.jobs.cost_estimate`)."""
    budget: BudgetLine | None
    """The tenant's monthly budget held against `cost.hold`; None: the quota sets no budget."""

    @property
    def accepted(self) -> bool:
        """Whether `job_submit` would accept the request now."""
        within_budget = self.budget is None or self.budget.refused is None
        return self.rejected is None and within_budget and all(line.refused is None for line in self.quota)


def job_dry_run(
    *,
    tenant: Tenant,
    request: JobRequest,
    input_roots: Sequence[str] | None = None,
    task: str | None = None,
) -> DryRunReport:
    """Report what `job_submit` would do with this request (its arguments, less `user`), storing nothing.

    A request `job_submit` refuses before reading the input's lines (an unknown model, bad params, an
    unreadable input, a model the quota excludes) raises the same `SubmissionError`. Bad lines and
    quota limits do not raise: the report lists the lines (`problems`, `rejected`) and each limit's
    refusal (`quota`), so one answer shows everything to fix; `accepted` says whether a submission
    would go through. Shards, tokens and estimates then cover the valid records.
    """
    accepted = submission_request(tenant=tenant, request=request, input_roots=input_roots, task=task)
    adapters = accepted.adapters()
    with input_errors():
        size = store_for(accepted.input_uri).size(accepted.input_uri)
    # Loaded before the budget's clock starts: its time does not depend on the input.
    counter = token_counter(accepted.model)
    budget = SampleBudget()
    limits = input_limits(tenant.pk)
    counted: int | None = None
    if size <= settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES:
        # Counted first, as job_submit counts it, so that the cut is the one the planner makes.
        uncounted = accepted.job(InputCheck(size=size, records=None), job_id=str(uuid.uuid4()))
        counted = _count(uncounted, input_field=accepted.input_field, budget=budget, limits=limits, adapters=adapters)
    # The job as job_submit would create it (its records known only where the input is checked at
    # submission), so that the cut is the one the planner makes.
    checked = InputCheck(size=size, records=counted)
    draft = accepted.job(checked, job_id=str(uuid.uuid4()))  # never saved
    cut = ShardCut.for_job(draft)
    outputs = OutputCaps(accepted.model, accepted.params) if accepted.model.task in GENERATING else None
    check, cuts, groups, tokens, read = _read(
        draft,
        cut=cut,
        input_field=accepted.input_field,
        counter=counter,
        outputs=outputs,
        budget=budget,
        limits=limits,
        adapters=adapters,
    )
    sample = _sample(budget, check, read=read, size=size, counted=counted)
    scale = sample.scale if sample is not None else 1.0
    shards = ShardPlan.of(cuts)
    if sample is not None:
        shards = replace(shards, count=math.ceil(len(cuts) * scale), listed=())
    input_tokens = tokens.total if tokens is not None else None

    seconds = sum(shard.estimated_seconds for shard in cuts) * scale
    gpu_seconds = seconds * accepted.model.gpus_per_replica
    queue = job_queue(draft)
    slots = queue_slots(queue)
    own, others, others_weight = _backlog(queue, tenant)
    longest = max((shard.estimated_seconds for shard in cuts), default=0.0)
    quota = Quota.objects.filter(tenant=tenant).first() or Quota(tenant=tenant)
    use = quota_usage(tenant_ids=[tenant.pk])[tenant.pk]
    estimated_records = counted if counted is not None else round(check.records * scale)
    estimated_tokens = round(input_tokens * scale) if input_tokens is not None else None
    cost = cost_estimate(
        model=accepted.model,
        adapter_ids=[int(entry["id"]) for entry in adapters.entries.values()],
        gpu_seconds=gpu_seconds,
        input_tokens=estimated_tokens,
        records=estimated_records,
        params=accepted.params,
        reach=_reach(sample, size=size),
        output_tokens=round(outputs.total * scale) if outputs is not None else None,
    )
    return DryRunReport(
        model=str(accepted.model),
        adapters=tuple(
            sorted(f"{entry['spec']['name']}@{entry['spec']['version']}" for entry in adapters.entries.values())
        ),
        input_bytes=size,
        unit=check.unit,
        sampled=sample is not None,
        sample=sample,
        records=check.records,
        estimated_records=estimated_records,
        problem_count=check.problem_count,
        problems=tuple(check.problems),
        rejected=None if check.ok else input_rejected(check).message,
        input_tokens=input_tokens,
        estimated_input_tokens=estimated_tokens,
        over_length=tokens.over_length() if tokens is not None else None,
        prefix_groups=groups,
        shards=shards,
        estimated_seconds=seconds,
        estimated_gpu_seconds=gpu_seconds,
        observed=cut.cost.observed,
        queue=queue,
        slots=slots,
        backlog_seconds=own + others,
        share=tenant.weight / (tenant.weight + others_weight),
        eta_seconds=eta_seconds(
            seconds=seconds,
            longest_shard=longest,
            own_backlog=own,
            others_backlog=others,
            slots=slots,
            weight=tenant.weight,
            others_weight=others_weight,
        ),
        quota=tuple(quota_lines(quota, use, input_bytes=size, records=checked.records, gpu_seconds=gpu_seconds)),
        cost=cost,
        budget=budget_line(quota, hold=cost.hold),
    )


def eta_seconds(
    *,
    seconds: float,
    longest_shard: float,
    own_backlog: float,
    others_backlog: float,
    slots: int,
    weight: float,
    others_weight: float,
) -> float:
    """When a job of `seconds` (its shards' estimated seconds) would end, in seconds from now.

    With E = `seconds`, Bt the tenant's own backlog on the queue, Bo the other tenants', s = `slots`,
    w the tenant's weight and W the summed weights of the other tenants with work on the queue, the
    tenant's share is f = w / (w + W) and

        ETA = max(longest shard, min((Bt + E) / (s·f), (Bt + Bo + E) / s))

    While the others have work, the scheduler gives the tenant about f of the slots, which go to its
    older work first, then to this job: the first term. Once the others' backlog is done the job has
    every slot, so it cannot end later than all the work on the queue over all the slots: the second
    term. With no one else waiting (f = 1) both are (Bt + E) / s; with no backlog of its own and a
    long one of the others', E / (s·f). A shard runs on one slot, so the longest bounds it below.
    Backlogs count shards both waiting and running, each as a whole (`_backlog`).
    """
    share = weight / (weight + others_weight)
    alone = (own_backlog + seconds) / (slots * share)
    everyone = (own_backlog + others_backlog + seconds) / slots
    return max(longest_shard, min(alone, everyone))


def _records(
    job: Job,
    *,
    input_field: str,
    check: JsonlCheck,
    budget: SampleBudget,
    limits: DecompressionLimits,
    adapters: JobAdapters,
) -> tuple[Iterator[Record], MeteredPosition]:
    position = MeteredPosition(budget)
    records = job_records(
        job,
        input_field=input_field,
        check=check,
        max_problems=settings.BATCHERY_MAX_REPORTED_PROBLEMS,
        position=position,
        limits=limits,
        record_problem=record_checks(job.model, adapters),
    )
    return records, position


def _count(
    job: Job, *, input_field: str, budget: SampleBudget, limits: DecompressionLimits, adapters: JobAdapters
) -> int | None:
    """The input's valid records, as job_submit counts a small input; None: the budget's bytes or time
    ran out first. Not held to the records' limit: counting is cheap, tokenizing is not."""
    check = JsonlCheck()
    records, _ = _records(job, input_field=input_field, check=check, budget=budget, limits=limits, adapters=adapters)
    with input_errors(), closing(cast(IO[Any], records)):
        try:
            for _ in records:
                budget.spend()
        except SampleEnds:
            return None
    return check.records


def _read(
    job: Job,
    *,
    cut: ShardCut,
    input_field: str,
    counter: TokenCounter | None,
    outputs: OutputCaps | None,
    budget: SampleBudget,
    limits: DecompressionLimits,
    adapters: JobAdapters,
) -> tuple[JsonlCheck, list[CutShard], PrefixGroups | None, _TokenTally | None, int]:
    """One pass over the input as the planner makes it, as far as the budget goes: the check, the
    shard cuts, the prefix groups, the token counts, and the input's bytes read (each record's output
    cap summed into `outputs`)."""
    check = JsonlCheck()
    budget.stopped_by = None  # a count cut short before: this pass alone says whether the input was read whole
    records, position = _records(
        job, input_field=input_field, check=check, budget=budget, limits=limits, adapters=adapters
    )
    cutter = ShardCutter(cut, input_field=input_field, bytes_read=position)
    tokens = _TokenTally(counter) if counter is not None else None
    prefix_key = prefix_key_for(job)
    # Each record's prefix key and size, to cut it again once the groups are known: BATCHERY_DRY_RUN_MAX_RECORDS
    # pairs of numbers at most.
    keys, sizes = array("Q"), array("Q")
    with input_errors(), closing(cast(IO[Any], records)):
        try:
            for record in records:
                # The record past the limit is not counted in: the sample holds max_records.
                budget.spend(records=check.records)
                cutter.add(record)
                if prefix_key is not None:
                    keys.append(prefix_key(record))
                    sizes.append(record_chars(record, input_field))
                if tokens is not None and not record.refused:
                    tokens.add(record.line, record.data.get(input_field))
                if outputs is not None:
                    outputs.add(record.data.get("params"))
        except SampleEnds:
            if check.records > budget.max_records:
                check.records = budget.max_records
    if tokens is not None:
        tokens.flush()
    cuts = cutter.close()
    grouped = grouped_cut(cut, input_field=input_field, keys=keys, sizes=sizes) if prefix_key is not None else None
    if grouped is None:
        return check, cuts, None, tokens, position.read_bytes
    grouped_cuts, groups, in_groups = grouped
    return check, grouped_cuts, PrefixGroups(groups, in_groups), tokens, position.read_bytes


def _reach(sample: DryRunSample | None, *, size: int) -> float:
    """How much further than the sample's own extrapolation the whole input may reach: a sample scaled by its
    records holds the start of the input, whose records may be shorter than the rest, so the budget's hold
    takes the larger of that scale and the input's bytes over the bytes read."""
    if sample is None or not sample.input_bytes_read:
        return 1.0
    return max(size / sample.input_bytes_read / sample.scale, 1.0)


def _sample(
    budget: SampleBudget, check: JsonlCheck, *, read: int, size: int, counted: int | None
) -> DryRunSample | None:
    """How the prefix read stands for the whole input; None: the whole input was read."""
    if budget.stopped_by is None:
        return None
    if counted is not None and check.records:
        basis, scale = "records", counted / check.records
    elif read:
        basis, scale = "bytes", max(size / read, 1.0)
    else:
        basis, scale = "none", 1.0
    return DryRunSample(
        records=check.records, input_bytes_read=read, stopped_by=budget.stopped_by, basis=basis, scale=scale
    )


class _TokenTally:
    """Counts the records' tokens a batch at a time; keeps the total and the records over the maximum."""

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter
        self._pending: list[tuple[int, Any]] = []
        self.total = 0
        self._over = 0
        self._over_lines: list[int] = []

    def add(self, line: int, value: Any) -> None:
        self._pending.append((line, value))
        if len(self._pending) >= TOKEN_BATCH:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        counts = self._counter.count([value for _, value in self._pending])
        self.total += sum(counts)
        maximum = self._counter.max_tokens
        if maximum is not None:
            for (line, _), count in zip(self._pending, counts, strict=True):
                if count > maximum:
                    self._over += 1
                    if len(self._over_lines) < settings.BATCHERY_MAX_REPORTED_PROBLEMS:
                        self._over_lines.append(line)
        self._pending.clear()

    def over_length(self) -> OverLength | None:
        maximum = self._counter.max_tokens
        if maximum is None:
            return None
        return OverLength(max_tokens=maximum, count=self._over, lines=tuple(self._over_lines))


def _backlog(queue: str, tenant: Tenant) -> tuple[float, float, float]:
    """(the tenant's seconds, the other tenants' seconds, the other tenants' summed weights) of the
    shards waiting or running on the queue, of jobs the scheduler serves."""
    jobs = queue_jobs(queue, statuses=SCHEDULABLE)
    # A shard cut before shards were costed counts at the default rate, as the scheduler charges it
    # (`portal.execution.costs.shard_cost_estimate`).
    default = F("record_count") * settings.BATCHERY_DEFAULT_SECONDS_PER_RECORD
    rows = (
        Shard.objects.filter(job__in=jobs, status__in=UNSETTLED)
        .values("job__tenant_id")
        .annotate(seconds=Sum(Coalesce("estimated_seconds", default, output_field=FloatField())))
    )
    by_tenant = {row["job__tenant_id"]: float(row["seconds"] or 0.0) for row in rows}
    others = [tenant_id for tenant_id in by_tenant if tenant_id != tenant.pk]
    weight = Tenant.objects.filter(pk__in=others).aggregate(total=Sum("weight"))["total"] or 0.0
    return by_tenant.get(tenant.pk, 0.0), sum(by_tenant[tenant_id] for tenant_id in others), float(weight)
