"""The dry run's report as the API answers it (`POST /api/v1/jobs/` with `dry_run`): what a submission would do."""

from __future__ import annotations

from rest_framework import serializers


class LineProblemSerializer(serializers.Serializer):
    line = serializers.IntegerField(help_text="1-based line (or row) number.")
    message = serializers.CharField()


class OverLengthSerializer(serializers.Serializer):
    max_tokens = serializers.IntegerField(help_text="The most tokens the model reads from one input.")
    count = serializers.IntegerField(help_text="Records with more tokens than that.")
    lines = serializers.ListField(child=serializers.IntegerField(), help_text="The first of them, by line number.")


class ShardEstimateSerializer(serializers.Serializer):
    records = serializers.IntegerField()
    seconds = serializers.FloatField(help_text="Estimated compute seconds on one replica.")


class ShardPlanSerializer(serializers.Serializer):
    count = serializers.IntegerField()
    listed = ShardEstimateSerializer(many=True, help_text="Each shard in order; empty past 100 shards.")
    min_records = serializers.IntegerField()
    median_records = serializers.FloatField()
    max_records = serializers.IntegerField()
    min_seconds = serializers.FloatField()
    median_seconds = serializers.FloatField()
    max_seconds = serializers.FloatField()


class PrefixGroupsSerializer(serializers.Serializer):
    groups = serializers.IntegerField(
        help_text="Groups of records whose prompts begin alike, each planned in shards of its own."
    )
    records = serializers.IntegerField(help_text="Records read that fall in a group.")


class QuotaLineSerializer(serializers.Serializer):
    quota = serializers.CharField(help_text="The limit's name.")
    limit = serializers.IntegerField()
    used = serializers.FloatField(help_text="Use so far (0 for a per-job limit).")
    adds = serializers.FloatField(allow_null=True, help_text="What this job adds; null: not counted at submission.")
    left = serializers.FloatField(allow_null=True, help_text="What would be left; below 0: over the limit.")
    refused = serializers.CharField(allow_null=True, help_text="Why a submission would be refused; null: it fits.")


class DryRunSampleSerializer(serializers.Serializer):
    records = serializers.IntegerField(help_text="Valid records read.")
    input_bytes_read = serializers.IntegerField(help_text="Bytes of the input as stored (compressed, if it is) read.")
    stopped_by = serializers.CharField(help_text="The setting whose limit ended the reading.")
    basis = serializers.CharField(
        help_text='How the estimates scale: "records" (the input\'s records were counted), "bytes" (its size over '
        'the bytes read), "none".'
    )
    scale = serializers.FloatField(help_text="The whole input over the part read: the factor of the estimates.")


class CostEstimateSerializer(serializers.Serializer):
    low = serializers.CharField(
        help_text='What the job costs at least, a decimal string in the minor unit, e.g. "1.20".'
    )
    high = serializers.CharField(
        allow_null=True,
        help_text="What it costs at most; null: no bound (a generating job whose params do not cap its output).",
    )
    currency = serializers.CharField(help_text="ISO 4217 code: the deployment's one currency.")
    priced = serializers.BooleanField(help_text="False: the model has no price in force, so the job costs nothing.")
    hold = serializers.CharField(
        help_text="What the monthly budget holds for the job while it runs: its whole input, the output its params "
        "allow (max_tokens, or the model's default, times n), at the dearest of its model's and adapters' prices."
    )


class BudgetLineSerializer(serializers.Serializer):
    limit = serializers.CharField(help_text="The tenant's monthly budget, a decimal string.")
    spent = serializers.CharField(
        help_text="This month's ended jobs' cost plus the holds of the tenant's jobs not ended."
    )
    adds = serializers.CharField(help_text="What this job holds (cost.hold).")
    left = serializers.CharField(help_text="What would be left; below 0: over the budget.")
    currency = serializers.CharField()
    refused = serializers.CharField(allow_null=True, help_text="Why a submission would be refused; null: it fits.")


class DryRunReportSerializer(serializers.Serializer):
    """What a submission would do, from `job_dry_run`; nothing was created."""

    accepted = serializers.BooleanField(help_text="Whether the job would be accepted now.")
    model = serializers.CharField(help_text="name@version.")
    adapters = serializers.ListField(
        child=serializers.CharField(),
        help_text="LoRA adapters (name@version) the job would run: the one it names and those its records read name.",
    )
    input_bytes = serializers.IntegerField()
    unit = serializers.CharField(help_text='What records are numbered by: "line", or "row" for Parquet.')
    sampled = serializers.BooleanField(
        help_text="True: only a prefix of the input was read (see sample); records, problems and tokens are the "
        "prefix's, and the estimates, the shard count and the ETA are extrapolated to the whole input."
    )
    sample = DryRunSampleSerializer(allow_null=True, help_text="How much was read and how it was extrapolated.")
    records = serializers.IntegerField(help_text="Valid records read.")
    estimated_records = serializers.IntegerField(help_text="Valid records of the whole input; estimated if sampled.")
    problem_count = serializers.IntegerField()
    problems = LineProblemSerializer(many=True, help_text="The first bad lines, as a submission names them.")
    rejected = serializers.CharField(allow_null=True, help_text="The refusal a submission would give the input.")
    input_tokens = serializers.IntegerField(allow_null=True, help_text="By the model's tokenizer; null: none.")
    estimated_input_tokens = serializers.IntegerField(
        allow_null=True, help_text="Tokens of the whole input; estimated if sampled."
    )
    over_length = OverLengthSerializer(allow_null=True)
    prefix_groups = PrefixGroupsSerializer(
        allow_null=True,
        help_text="How the planner would keep records sharing a long prompt beginning together (their prefix's KV "
        "cache is then computed in few shards); null: planned ungrouped.",
    )
    shards = ShardPlanSerializer(help_text="For a grouped job, the shards of each group and of the other records.")
    estimated_seconds = serializers.FloatField(help_text="Compute seconds of all shards on one replica.")
    estimated_gpu_seconds = serializers.FloatField(help_text="Times the model's GPUs per replica.")
    observed = serializers.BooleanField(help_text="True: learned from the model's finished shards; false: a default.")
    queue = serializers.CharField()
    slots = serializers.IntegerField()
    backlog_seconds = serializers.FloatField(help_text="Estimated seconds of the shards already on the queue.")
    share = serializers.FloatField(help_text="The tenant's fraction of the queue while others have work on it.")
    eta_seconds = serializers.FloatField(help_text="Estimated seconds until the job would end.")
    quota = QuotaLineSerializer(many=True)
    cost = CostEstimateSerializer(help_text="The bounds of the job's cost at today's prices.")
    budget = BudgetLineSerializer(
        allow_null=True, help_text="The tenant's monthly budget held against the job's hold; null: none set."
    )
