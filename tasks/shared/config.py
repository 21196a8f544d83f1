"""Celery configuration, read from the environment once.

The portal, the control worker and every GPU worker build their Celery app from this one module,
so reliability settings (visibility timeout, acks, prefetch) are identical everywhere.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from kombu import Exchange, Queue

from tasks.shared.env import (
    EnvVar,
    ImproperlyConfiguredEnv,
    declare,
    env_bool,
    env_int,
    float_var,
    int_var,
    list_var,
    str_var,
)

REPO_DIR = Path(__file__).resolve().parents[2]
CONTROL_QUEUE = "control"
# Work that a tenant can make slow or plentiful runs on queues and workers of its own, so that it
# never waits in front of the control lane's settling, scheduling and merging.
WEBHOOKS_QUEUE = "webhooks"
"""Webhook deliveries and their sweep: a receiver may take an attempt's whole deadline to answer."""
VALIDATION_QUEUE = "validation"
"""Validation of large `/v1/batches` input files: a tenant may queue many, each reading a large file."""
PLANNING_QUEUE = "planning"
"""Planning: an input of millions of records holds a process for minutes, and a burst of submissions
queues thousands of plans; on the control queue they waited in front of the endings that free GPUs."""
# Task names: every message is sent by name (`tasks.send`), so senders never import a task module.
SHARD_TASK = "batchery.run_shard"
"""Runs one shard on a slot (`tasks.slot.run_shard.run_shard`)."""
WAVE_TASK = "batchery.run_shards"
"""Runs a wave of short shards in one message on a slot (`tasks.slot.run_shard.run_shards`)."""
SLOT_INFO_TASK = "batchery.slot_info"
"""What a slot's process sees, for operators and tests (`tasks.slot.diagnostics`)."""
PLAN_TASK = "batchery.plan_job"
"""Cuts a queued job's input into shards (`tasks.control.plan`)."""
COMPARE_TASK = "batchery.compare_rerun"
"""Writes a re-run's comparison report once it has ended (`tasks.control.compare`)."""
SHARDS_ENDED_TASK = "batchery.shard_done"
"""The callback of a chord of shards: reports their endings (`tasks.control.shard_done`)."""
MERGE_TASK = "batchery.merge_job"
"""Merges a job's committed outputs and ends it, or finalizes a stopped job (`tasks.control.merge`)."""
RECONCILE_TASK = "batchery.reconcile"
"""The periodic sweep (`tasks.control.reconcile`)."""
RETENTION_TASK = "batchery.retention_sweep"
"""Removes the shard rows and events of jobs past their retention (`tasks.control.retention`)."""
VALIDATE_BATCH_TASK = "batchery.validate_batch"
"""Validates a large `/v1/batches` input file off the request (`tasks.control.validate_batch`)."""
FINALIZE_BATCH_TASK = "batchery.finalize_batch"
"""Writes an ended batch's OpenAI output and error files (`tasks.control.finalize_batch`)."""
DELIVER_WEBHOOK_TASK = "batchery.deliver_webhook"
"""One attempt at a webhook delivery (`tasks.control.webhooks`)."""
WEBHOOKS_SWEEP_TASK = "batchery.webhooks_sweep"
"""The periodic sweep of overdue webhook deliveries (`tasks.control.webhooks`)."""
CONTROL_TASKS = (SHARDS_ENDED_TASK, MERGE_TASK, RECONCILE_TASK, RETENTION_TASK, FINALIZE_BATCH_TASK)
PLANNING_TASKS = (PLAN_TASK, COMPARE_TASK)
WEBHOOK_TASKS = (DELIVER_WEBHOOK_TASK, WEBHOOKS_SWEEP_TASK)
VALIDATION_TASKS = (VALIDATE_BATCH_TASK,)
TASK_QUEUES = {
    **dict.fromkeys(CONTROL_TASKS, CONTROL_QUEUE),
    **dict.fromkeys(WEBHOOK_TASKS, WEBHOOKS_QUEUE),
    **dict.fromkeys(VALIDATION_TASKS, VALIDATION_QUEUE),
    **dict.fromkeys(PLANNING_TASKS, PLANNING_QUEUE),
}
"""The queue of each task of the control side (the portal's database is near: `tasks.control`)."""
GPU_QUEUE_PREFIX = "gpu."

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"


# Read when called (tests and the development stack set them after import), declared here once.
VAR_DIR = str_var(
    "BATCHERY_VAR_DIR",
    str(REPO_DIR / "var"),
    default_text="`var/` in the checkout",
    doc="Local state where nothing is configured: the SQLite file, the embedded Redis, file storage.",
)
STORAGE_URL = str_var(
    "BATCHERY_STORAGE_URL",
    doc="Batchery's own storage: `file:///…` or `s3://bucket/prefix`; unset, `storage` under BATCHERY_VAR_DIR.",
)
METRICS_TOKEN = str_var(
    "BATCHERY_METRICS_TOKEN",
    doc="Bearer token the portal's and the launchers' /metrics ask for (or BATCHERY_METRICS_TOKEN_FILE); unset, "
    "they are open. Every shipped deployment sets it.",
)
BROKER_URL = str_var("CELERY_BROKER_URL", DEFAULT_BROKER_URL, doc="The broker (Redis).")
RESULT_BACKEND = str_var("CELERY_RESULT_BACKEND", doc="Chord counters and task results; unset, the broker.")
PROGRESS_REDIS_URL = str_var(
    "BATCHERY_PROGRESS_REDIS_URL",
    doc="The Redis of live progress and leases; unset, the result backend's or the broker's.",
)
GPU_QUEUES = list_var(
    "BATCHERY_GPU_QUEUES",
    [f"{GPU_QUEUE_PREFIX}cpu"],
    doc="GPU queues declared at start (others are created when first used).",
)


def metrics_token() -> str:
    """The bearer token /metrics asks for (`Authorization: Bearer <token>`); "" where none is set."""
    return METRICS_TOKEN.read()


def var_dir() -> Path:
    """Local state of a machine with nothing configured: SQLite file, embedded Redis, storage."""
    return Path(VAR_DIR.read())


def storage_url() -> str:
    """Batchery's own storage: shard inputs, attempts, outputs and the published catalog."""
    return STORAGE_URL.read(default=(var_dir() / "storage").as_uri())


def broker_url() -> str:
    return BROKER_URL.read()


def result_backend_url() -> str:
    return RESULT_BACKEND.read(default=broker_url())


def progress_redis_url() -> str:
    """Live progress counters live in Redis: the result backend's, or the broker's if that is Redis."""
    explicit = PROGRESS_REDIS_URL.read()
    if explicit:
        return explicit
    for url in (result_backend_url(), broker_url()):
        if url.startswith(("redis://", "rediss://", "unix://")):
            return url
    return DEFAULT_BROKER_URL


def declared_queues() -> list[str]:
    """The control side's queues and the GPU queues this site runs (`BATCHERY_GPU_QUEUES`, default gpu.cpu)."""
    return [CONTROL_QUEUE, PLANNING_QUEUE, WEBHOOKS_QUEUE, VALIDATION_QUEUE, *GPU_QUEUES.read()]


def message_priority(tenant_priority: int) -> int:
    """The broker priority of a tenant's shards: tenants rank 0 (lowest) to 9 (highest); the Redis
    transport serves 0 first, so the scale is turned round."""
    return 9 - max(0, min(9, tenant_priority))


def gpu_queue(gpu_class: str, gpus_per_replica: int = 1) -> str:
    """`gpu.<class>` for one GPU, `gpu.<class>.x<N>` for replicas that span N GPUs."""
    name = f"{GPU_QUEUE_PREFIX}{gpu_class}"
    return name if gpus_per_replica == 1 else f"{name}.x{gpus_per_replica}"


def slot_own_queue(queue: str, worker: str) -> str:
    """The queue only one slot consumes, beside its class's `queue`: the scheduler sends there the shards of a
    job whose LoRA adapters that slot holds (`portal.execution.adapter_routes`). Named by the slot's
    Celery node name (`worker`), which is unique in the fleet and the same across its restarts."""
    return f"{queue}.slot.{worker}"


def queue_readings(queue: str) -> list[tuple[str, int]]:
    """Every (GPU class, GPUs a replica) whose `gpu_queue` is `queue`, the plain class first: a class
    may itself be named like a size suffix (`a100.x2`). Empty for the control queue."""
    if not queue.startswith(GPU_QUEUE_PREFIX):
        return []
    name = queue.removeprefix(GPU_QUEUE_PREFIX)
    head, _, size = name.rpartition(".x")
    candidates = [(name, 1), *([(head, int(size))] if head and size.isdigit() else [])]
    return [reading for reading in candidates if gpu_queue(*reading) == queue]


def queue_gpu_class(queue: str) -> str:
    """The GPU class a queue serves (`gpu.h100-80gb.x2` -> `h100-80gb`); "" for the control queue."""
    readings = queue_readings(queue)
    return readings[-1][0] if readings else ""


# The longest a shard may run before it is killed; the visibility timeout must exceed it, or Redis
# hands an unacknowledged shard to a second worker while the first is still running it.
SHARD_HARD_TIME_LIMIT_S = env_int(
    "BATCHERY_SHARD_TIME_LIMIT_S", 3600, minimum=2, doc="The longest a shard may run; the same on every host."
)
VISIBILITY_TIMEOUT_S = int_var(
    "BATCHERY_VISIBILITY_TIMEOUT_S",
    0,
    minimum=3,
    default_text="the shard time limit + 600",
    doc="Seconds before Redis hands an unacknowledged message to another worker; must exceed the shard time limit.",
).read(default=SHARD_HARD_TIME_LIMIT_S + 600)
if VISIBILITY_TIMEOUT_S <= SHARD_HARD_TIME_LIMIT_S:
    raise ImproperlyConfiguredEnv(
        f"BATCHERY_VISIBILITY_TIMEOUT_S={VISIBILITY_TIMEOUT_S} must exceed the shard time limit "
        f"({SHARD_HARD_TIME_LIMIT_S} s), or a running shard is handed to a second worker"
    )
# Planning and merging read and write whole inputs and outputs, minutes for a large one: their limit
# is their own, not the shard's, which a site may set short (the tests' stacks set 20 s).
CONTROL_HARD_TIME_LIMIT_S = env_int(
    "BATCHERY_CONTROL_TIME_LIMIT_S", 3600, minimum=10, doc="The longest a control task (planning, merging) may run."
)
CONTROL_SOFT_TIME_LIMIT_S = max(CONTROL_HARD_TIME_LIMIT_S - 60, CONTROL_HARD_TIME_LIMIT_S // 2)
# On SIGTERM a slot's worker (the launcher remaps it to Celery's soft shutdown) lets its running
# shard go on this long, then stops it; the message goes back to the queue. By default a shard may
# finish; an orchestrator with a short grace period sets it shorter.
SOFT_SHUTDOWN_S = int_var(
    "BATCHERY_SOFT_SHUTDOWN_S",
    0,
    minimum=0,
    default_text="the shard time limit",
    doc="On SIGTERM a slot lets its shard run this long, then puts it back.",
).read(default=SHARD_HARD_TIME_LIMIT_S)
RESULT_EXPIRES_S = env_int(
    "BATCHERY_RESULT_EXPIRES_S",
    14 * 24 * 3600,
    minimum=3600,
    doc="How long task results and live progress are kept in Redis.",
)
# A pool process preloads its models (`launch --preload`) before it tells its worker it is up; Celery
# kills one that stays silent past its default of 4 s, and a real model takes a minute to load.
PROCESS_START_TIMEOUT_S = env_int(
    "BATCHERY_PROCESS_START_TIMEOUT_S",
    900,
    minimum=4,
    doc="How long a slot's process may take to preload its models before Celery gives up on it.",
)
TASK_EVENTS = env_bool(
    "BATCHERY_TASK_EVENTS",
    False,
    doc="Workers send Celery task events from their start (Flower turns them on itself when it runs).",
)


def celery_settings() -> dict[str, object]:
    """The Celery settings every process uses, as lowercase setting names."""
    return {
        "broker_url": broker_url(),
        "result_backend": result_backend_url(),
        "broker_connection_retry_on_startup": True,
        # Ten priority levels (Redis emulates them with one list per level; 0 is served first). A
        # worker consuming several queues takes them in turn: kombu's "priority" order would serve
        # the first queue for as long as it holds messages and starve the others.
        "broker_transport_options": {
            "visibility_timeout": VISIBILITY_TIMEOUT_S,
            "priority_steps": list(range(10)),
            "queue_order_strategy": "round_robin",
        },
        "result_backend_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT_S},
        "result_expires": RESULT_EXPIRES_S,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        # At-least-once: a message is acknowledged only after its task ran, and a worker that dies
        # mid-task gives the message back. Output commits make the second run harmless.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # A cold shutdown (SIGQUIT; SIGTERM for slots, see the launcher) first gives running tasks
        # this long, then stops them; acks_late puts their messages back.
        "worker_soft_shutdown_timeout": float(SOFT_SHUTDOWN_S),
        "worker_proc_alive_timeout": float(PROCESS_START_TIMEOUT_S),
        "task_time_limit": SHARD_HARD_TIME_LIMIT_S,
        "task_soft_time_limit": max(SHARD_HARD_TIME_LIMIT_S - 60, SHARD_HARD_TIME_LIMIT_S // 2),
        # No STARTED state in the result backend: nothing reads it (a shard's live attempt is its lease,
        # Flower has the task-started event), and writing it costs every task a round trip before it runs.
        "task_track_started": False,
        # Task events feed Flower and nothing else: a publish for each of sent, received, started and succeeded,
        # for a shard's task and for its callback, a large share of a short shard's Redis commands. Flower
        # turns them on in running workers itself (`enable_events`, every 5 s); this sends them from the start,
        # the publishers' task-sent events too.
        "task_send_sent_event": TASK_EVENTS,
        "worker_send_task_events": TASK_EVENTS,
        "task_default_queue": CONTROL_QUEUE,
        "task_queues": tuple(Queue(name, Exchange(name), routing_key=name) for name in declared_queues()),
        # Queues of GPU classes not listed in BATCHERY_GPU_QUEUES are created when first routed to.
        "task_create_missing_queues": True,
        "task_routes": {name: {"queue": queue} for name, queue in TASK_QUEUES.items()},
        "beat_schedule": {
            "reconcile": {
                "task": RECONCILE_TASK,
                "schedule": float(RECONCILE_INTERVAL_S),
                # A reconcile that waited longer than its interval is stale; the next one replaces it.
                "options": {"expires": float(RECONCILE_INTERVAL_S)},
            },
            # Webhook retries delayed past the task's countdown bound, and deliveries whose message was lost.
            "webhooks-sweep": {
                "task": WEBHOOKS_SWEEP_TASK,
                "schedule": float(WEBHOOKS_SWEEP_INTERVAL_S),
                "options": {"expires": float(WEBHOOKS_SWEEP_INTERVAL_S)},
            },
            # Shard rows and events of jobs past their retention, a bounded amount each time.
            "retention-sweep": {
                "task": RETENTION_TASK,
                "schedule": float(RETENTION_SWEEP_INTERVAL_S),
                "options": {"expires": float(RETENTION_SWEEP_INTERVAL_S)},
            },
        },
        "worker_hijack_root_logger": False,
    }


# Attempts of a shard that end in a dead worker before it is re-run range by range, with
# checkpoints, to find the records that kill the worker ("poison records").
SHARD_ATTEMPTS_BEFORE_BISECT = env_int(
    "BATCHERY_SHARD_ATTEMPTS_BEFORE_BISECT",
    3,
    minimum=1,
    doc="Attempts of a shard that end in a dead worker before it is re-run range by range to find poison records.",
)
# Past this many attempts, whatever range is still killing the worker is given up as poison.
SHARD_MAX_ATTEMPTS = env_int(
    "BATCHERY_SHARD_MAX_ATTEMPTS",
    40,
    minimum=2,
    doc="Past this many attempts, the range still killing the worker is given up as poison.",
)
# Times a shard may be dispatched (lost messages, timeouts) before it fails for good.
SHARD_MAX_DISPATCHES = env_int(
    "BATCHERY_SHARD_MAX_DISPATCHES", 8, minimum=1, doc="Times a shard may be sent before it fails for good."
)
RECONCILE_INTERVAL_S = env_int(
    "BATCHERY_RECONCILE_INTERVAL_S", 30, minimum=1, doc="Seconds between two periodic sweeps."
)
WEBHOOKS_SWEEP_INTERVAL_S = 60
RETENTION_SWEEP_INTERVAL_S = 600
"""Seconds between two retention sweeps; each deletes for a minute at most (`portal.jobs.services.retention`)."""
LEASE_TTL_S = env_int(
    "BATCHERY_LEASE_TTL_S",
    30,
    minimum=2,
    doc="Seconds a lease (a shard attempt, a planner, a merger) lives without renewal.",
)
HEARTBEAT_INTERVAL_S = env_int(
    "BATCHERY_HEARTBEAT_INTERVAL_S",
    5,
    minimum=1,
    doc="Seconds between a slot's heartbeats; a slot silent three times as long drops out of the fleet.",
)
S3_MIN_PART_BYTES = 5 * 1024 * 1024
"""S3's smallest part, for every part of an upload but the last."""
S3_PART_BYTES = int_var(
    "BATCHERY_S3_PART_BYTES", 16 * 1024 * 1024, minimum=S3_MIN_PART_BYTES, doc="Part size of multipart S3 writes."
)
# What one request may ask of the shared GPUs: checked at submission (a job's params, each line of an
# OpenAI batch) and again by the engine for each record's own params.
MAX_N = int_var("BATCHERY_MAX_N", 16, minimum=1, doc="The most completions (`n`) one request may ask for.")
MAX_OUTPUT_TOKENS = int_var(
    "BATCHERY_MAX_OUTPUT_TOKENS",
    32768,
    minimum=1,
    doc="The most tokens (`max_tokens`, `max_completion_tokens`) one request may ask to generate.",
)
# Media in chat messages: checked at submission against the model's catalog entry, and again on the slot
# before vLLM's chat parser, which would fetch any URL it is given from the GPU host.
MAX_MEDIA_BYTES = int_var(
    "BATCHERY_MAX_MEDIA_BYTES",
    8 * 1024 * 1024,
    minimum=1,
    default_text="8 MiB",
    doc="The most bytes one media part of a chat message may hold (its `data:` URL or base64 data, as written).",
)
MAX_MEDIA_RECORD_BYTES = int_var(
    "BATCHERY_MAX_MEDIA_RECORD_BYTES",
    16 * 1024 * 1024,
    minimum=1,
    default_text="16 MiB",
    doc="The most bytes of media all the messages of one chat record may hold together.",
)


def is_host_name(host: str) -> bool:
    """A DNS name, not an IP address in any spelling resolvers take (``2130706433``, ``0x7f.1``, ``[::1]``)."""
    if not host or ":" in host or host.startswith("["):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return not re.fullmatch(r"(0x[0-9a-f]*|[0-9]+)", host.rstrip(".").rsplit(".", 1)[-1], re.IGNORECASE)
    return False


def _media_hosts(name: str, raw: str) -> list[str]:
    hosts = [host.strip().lower() for host in raw.split(",") if host.strip()]
    if addresses := [host for host in hosts if not is_host_name(host)]:
        # A listed address could be a private or a metadata one; a name is the operator's to keep public.
        raise ImproperlyConfiguredEnv(
            f"{name} lists {', '.join(addresses)}: media hosts are DNS names, never addresses"
        )
    return hosts


MEDIA_ALLOWED_HOSTS = declare(
    EnvVar[list[str]](
        "BATCHERY_MEDIA_ALLOWED_HOSTS",
        "list",
        [],
        "Host names (exact, comma-separated; no IP addresses) whose `https://` media URLs chat records may give, "
        "fetched by the GPU host without following redirects; unset, only `data:` URLs are taken.",
        _media_hosts,
    )
)
# A `json_schema` (a response_format's, or the tools' a reply is decoded to) is compiled into a grammar on the
# shared slot; its cost grows with these.
MAX_JSON_SCHEMA_BYTES = int_var(
    "BATCHERY_MAX_JSON_SCHEMA_BYTES",
    64 * 1024,
    minimum=2,
    default_text="64 KiB",
    doc="The most bytes (compact JSON) of the schema a request's structured output or tools are decoded to.",
)
MAX_JSON_SCHEMA_DEPTH = int_var(
    "BATCHERY_MAX_JSON_SCHEMA_DEPTH",
    32,
    minimum=1,
    doc="The deepest nesting of objects and arrays in such a schema, the schema itself being the first level.",
)
MAX_JSON_SCHEMA_PROPERTIES = int_var(
    "BATCHERY_MAX_JSON_SCHEMA_PROPERTIES",
    1000,
    minimum=1,
    doc="The most properties (the names under every `properties` of it, all levels together) such a schema may have.",
)
GRAMMAR_COMPILE_TIMEOUT_S = float_var(
    "BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S",
    10.0,
    minimum=0.1,
    doc="Seconds a vLLM slot lets one distinct JSON schema compile into a grammar before refusing it (its "
    "records error); compiled once per schema in a process of the slot's own.",
)
# Compressed inputs (gzip, zstd) are read through `tasks.shared.formats.compression.decompressed`,
# which stops at these: a few hundred KB may otherwise expand into gigabytes in a request or on the
# shared storage the planner writes shard inputs to.
MAX_DECOMPRESSED_BYTES = int_var(
    "BATCHERY_MAX_DECOMPRESSED_BYTES",
    10 * 1024 * 1024 * 1024,
    minimum=1,
    default_text="10 GiB",
    doc="The most bytes a compressed job input may decompress to (a tenant's quota max_input_bytes may lower it).",
)
MAX_PARQUET_ROW_BYTES = int_var(
    "BATCHERY_MAX_PARQUET_ROW_BYTES",
    16 * 1024 * 1024,
    minimum=1,
    doc="The most bytes one row of a Parquet input may hold, decoded (its text and custom_id): a JSONL line's "
    "bound, which dictionary encoding would otherwise let a small file multiply.",
)
MAX_COMPRESSION_RATIO = float_var(
    "BATCHERY_MAX_COMPRESSION_RATIO",
    100.0,
    minimum=1.0,
    doc="The most a compressed job input may expand (decompressed bytes per compressed byte), past its first 64 MiB.",
)
