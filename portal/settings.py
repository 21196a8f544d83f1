"""Django settings: one file, every value from the environment, safe defaults for local use.

With no DATABASE_URL the portal uses a SQLite file under var/ (enough for `make demo`); deployments
set DATABASE_URL to PostgreSQL.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url

from tasks.shared.config import metrics_token, progress_redis_url, storage_url, var_dir
from tasks.shared.env import ImproperlyConfiguredEnv, env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = var_dir()

DEBUG = env_bool("DEBUG", default=False, doc="Django's debug mode; never on a shared host.")
SECRET_KEY = env_str(
    "SECRET_KEY",
    "insecure-local-development-key-change-me",
    doc="Django's secret key (or SECRET_KEY_FILE); the local default is refused where "
    "BATCHERY_REQUIRE_SECRET_KEY is set.",
)
BATCHERY_REQUIRE_SECRET_KEY = env_bool(
    "BATCHERY_REQUIRE_SECRET_KEY",
    default=False,
    doc="Refuse to start with the local development secret key (deployments set it).",
)
if not DEBUG and SECRET_KEY.startswith("insecure-") and BATCHERY_REQUIRE_SECRET_KEY:
    raise RuntimeError("SECRET_KEY must be set in production (BATCHERY_REQUIRE_SECRET_KEY is on)")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"], doc="Host names the portal answers to.")
# Origins (scheme://host[:port]) whose forms may POST here besides the portal's own host: needed
# when the proxy in front rewrites the Host header.
CSRF_TRUSTED_ORIGINS = env_list(
    "CSRF_TRUSTED_ORIGINS", [], doc="Origins (scheme and host) trusted for forms posted over HTTPS behind a proxy."
)

# HTTPS behind a TLS-terminating proxy (an ingress, a load balancer, Caddy in deploy/compose). Off by
# default because `up` serves plain HTTP on 127.0.0.1; the deployment files turn every one on, and
# `manage.py check --deploy` names any they miss.
_PROXY_SSL_HEADER = env_str(
    "SECURE_PROXY_SSL_HEADER", doc="The header a TLS-terminating proxy sets to `https` (e.g. `X-Forwarded-Proto`)."
)
# The header the proxy sets to "https" (e.g. X-Forwarded-Proto). The proxy must overwrite a client's
# own copy of it, or a client on plain HTTP could pass as HTTPS.
if _PROXY_SSL_HEADER and not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", _PROXY_SSL_HEADER):
    raise ImproperlyConfiguredEnv(
        f"SECURE_PROXY_SSL_HEADER={_PROXY_SSL_HEADER!r} is not a header name (such as X-Forwarded-Proto)"
    )
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https") if _PROXY_SSL_HEADER else None
)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", default=False, doc="Redirect plain HTTP to HTTPS.")
# Kubelet probes and Prometheus reach a portal process over plain HTTP from inside the site, past
# the proxy; a redirect to https:// would fail them.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0, minimum=0, doc="HSTS max-age; 0 sends no HSTS header.")
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool(
    "SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False, doc="HSTS covers subdomains."
)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", default=False, doc="HSTS asks to be preloaded.")
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", default=False, doc="Session cookies over HTTPS only.")
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", default=False, doc="CSRF cookies over HTTPS only.")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "portal.tenancy",
    "portal.catalog",
    "portal.jobs",
    "portal.ops",
    "portal.devstack",
    "portal.openai_api",
    "portal.anthropic_api",
    "portal.audit",
    "portal.webhooks",
    "portal.web",
]
# The benchmarks (`manage.py bench`) are an app of a checkout; an image leaves the folder out.
if (BASE_DIR / "bench" / "apps.py").exists():
    INSTALLED_APPS.append("bench")

MIDDLEWARE = [
    # First and last: django-prometheus times each request from end to end (django_http_* metrics).
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Before anything reads a body: one over its limit is refused from its headers (413).
    "portal.api.body_limit.RequestBodyLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.ops.middleware.DatabaseUnavailableMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


DATABASE_URL = env_str(
    "DATABASE_URL",
    doc="The database (PostgreSQL in any real deployment); unset, a SQLite file under BATCHERY_VAR_DIR.",
)
DATABASE_CONN_MAX_AGE = env_int(
    "DATABASE_CONN_MAX_AGE", 60, doc="Seconds a database connection is kept between requests and tasks."
)


def _database() -> dict[str, Any]:
    if DATABASE_URL:
        return dict(dj_database_url.parse(DATABASE_URL, conn_max_age=DATABASE_CONN_MAX_AGE, conn_health_checks=True))
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # Several processes (portal, control worker) share the file: WAL lets readers run beside the
    # writer, and IMMEDIATE transactions take the write lock up front instead of failing later.
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": VAR_DIR / "batchery.sqlite3",
        "OPTIONS": {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        # A file, not memory, so worker processes started by tests see the test database too.
        "TEST": {"NAME": VAR_DIR / "test.sqlite3"},
    }


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    # The 20,000 passwords guessed first are refused, whatever their length.
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "web:dashboard"
LOGOUT_REDIRECT_URL = "login"

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # BATCHERY_LOG_FORMAT picks text or JSON lines; the same formatter and context filter as the workers'.
    "formatters": {"default": {"()": "gpuworkers.logs.env_formatter"}},
    "filters": {"context": {"()": "gpuworkers.logs.LogContextFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "default", "filters": ["context"]}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO", doc="The root logger's level.")},
    # Django's own handlers for these print bare messages (with DEBUG on, or under runserver); their
    # records go to the root handler instead, so each is written once, in the chosen format.
    "loggers": {
        "django": {"handlers": [], "propagate": True},
        "django.server": {"handlers": [], "propagate": True},
    },
}

# When set, the portal's /metrics asks for `Authorization: Bearer <token>` (Prometheus's
# `authorization` scrape setting); unset, it answers anyone who reaches the portal. Declared with the
# launchers' (tasks.shared.config), which ask for the same token.
BATCHERY_METRICS_TOKEN = metrics_token()

# The scheduler (portal.execution.scheduler): tenants' GPU-seconds decay with this half-life, so
# fair share looks at recent use; each live slot of a class gets this many shards in the broker at
# a time (the one it runs and the next), and a class with no slot heartbeat (plain workers) this many.
BATCHERY_RECONCILE_STALE_AFTER_S = env_int(
    "BATCHERY_RECONCILE_STALE_AFTER_S",
    60,
    minimum=1,
    doc="A step untouched this long, with no lease and no message, is presumed lost by the sweep.",
)
BATCHERY_FAIR_SHARE_HALF_LIFE_S = env_float(
    "BATCHERY_FAIR_SHARE_HALF_LIFE_S",
    3600.0,
    minimum=1.0,
    doc="Half-life of the tenants' GPU-seconds that fair share compares.",
)
BATCHERY_SCHEDULER_SHARDS_PER_SLOT = env_int(
    "BATCHERY_SCHEDULER_SHARDS_PER_SLOT", 2, minimum=1, doc="Shards in the broker per live slot of a queue."
)
BATCHERY_SCHEDULER_DEFAULT_WINDOW = env_int(
    "BATCHERY_SCHEDULER_DEFAULT_WINDOW",
    8,
    minimum=1,
    doc="Shards in the broker for a queue whose slots send no heartbeat.",
)
# Short shards: a slot gets more of them, up to this much estimated work (of the longest waiting
# shard) and this many, so that it never idles while its last shard's ending is being settled.
BATCHERY_SCHEDULER_SECONDS_AHEAD = env_float(
    "BATCHERY_SCHEDULER_SECONDS_AHEAD",
    1.0,
    minimum=0.0,
    doc="Shards shorter than this get more places a slot, up to this much estimated work.",
)
BATCHERY_SCHEDULER_MAX_SHARDS_PER_SLOT = env_int(
    "BATCHERY_SCHEDULER_MAX_SHARDS_PER_SLOT",
    64,
    minimum=1,
    doc="The most places a slot gets, however short its shards.",
)
# A job of at most this many records merges in the callback that settled its last shard instead of
# in a merge task of its own: one message hop less, most of a small job's tail; 0 sends every merge.
BATCHERY_INLINE_MERGE_MAX_RECORDS = env_int(
    "BATCHERY_INLINE_MERGE_MAX_RECORDS",
    100,
    minimum=0,
    doc="A job of at most this many records merges in the callback that settled its last shard; 0 sends every merge.",
)
# Retention (portal.jobs.services.retention): a job that ended longer ago than this loses its shard
# rows and status events (the job row, its counts and its ledger line stay); it can be retried only
# while it keeps them. 0 keeps them forever.
BATCHERY_SHARD_RETENTION_DAYS = env_int(
    "BATCHERY_SHARD_RETENTION_DAYS",
    30,
    minimum=0,
    doc="Days an ended job keeps its shard rows and status events, and can be retried; 0 keeps them forever.",
)
# Stragglers: once a job has no shard left to send, a slot that would idle runs a copy of its slowest
# running shard (one copy per shard at most); the first commit wins and the other attempt stops.
BATCHERY_SPECULATION = env_bool(
    "BATCHERY_SPECULATION", True, doc="Run a copy of a straggling shard on a slot that would idle."
)

BATCHERY_ALLOW_MIXED_WEIGHTS = env_bool(
    "BATCHERY_ALLOW_MIXED_WEIGHTS",
    False,
    doc="Accept a job whose shards ran on different weights of its model (slots whose files differ under one "
    "catalog name), its manifest marking it; false fails such a job at its merge, naming each digest and host.",
)

# Batchery's own storage: shard inputs, attempt outputs and final outputs live under it.
BATCHERY_STORAGE_URL = storage_url()
# Inputs up to this size are checked line by line at submission, so a bad file is refused before a
# job exists; larger ones are checked by the planner while their first shards run, which fails the
# job naming the lines (or the tenant's max_queued_records they pass). Small: the check reads the
# whole input before the job exists (about 60 MB/s of sentences on one core), and a job's first
# result is due within a second of its submission.
BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = env_int(
    "BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES",
    4 * 1024 * 1024,
    minimum=0,
    doc="An input up to this size is checked line by line before the job exists; a larger one by its planner.",
)
# A dry run answers within a web request: it reads at most this much of the input and extrapolates
# to the whole (the report says it did, and from what). 20,000 records tokenize in about a second on
# one core; 8 MiB holds them for sentences of a few hundred characters.
BATCHERY_COMPARISON_NEIGHBOUR_SAMPLE = env_int(
    "BATCHERY_COMPARISON_NEIGHBOUR_SAMPLE",
    200,
    minimum=1,
    doc="A re-run's comparison of embeddings compares the 10 nearest neighbours of this many sampled records.",
)
BATCHERY_COMPARISON_INLINE_RECORDS = env_int(
    "BATCHERY_COMPARISON_INLINE_RECORDS",
    5_000,
    minimum=0,
    doc="A read (API, portal) that finds no comparison report written computes it only for a re-run of at most "
    "this many records; past it the comparison task writes it and the read answers 202.",
)
# Edit distance costs about the product of the two lengths (bit-parallel: 7 ms for two texts of 4,000
# characters, 0.6 s for 50,000), and a generation may be long: each text is compared on its prefix.
BATCHERY_COMPARISON_TEXT_CHARS = env_int(
    "BATCHERY_COMPARISON_TEXT_CHARS",
    4_000,
    minimum=1,
    doc="A re-run's comparison of generations measures the edit distance between the first this many characters "
    "of each text (exact matches and length changes see whole texts).",
)
BATCHERY_COMPARISON_VECTOR_BYTES = env_int(
    "BATCHERY_COMPARISON_VECTOR_BYTES",
    256 * 1024 * 1024,
    minimum=0,
    doc="Memory for the old and new vectors (float32) a re-run's comparison searches neighbours among; records "
    "past it are compared by cosine only.",
)
BATCHERY_DRY_RUN_MAX_RECORDS = env_int(
    "BATCHERY_DRY_RUN_MAX_RECORDS",
    20_000,
    minimum=1,
    doc="A dry run reads at most this many valid records of the input, and extrapolates past them.",
)
BATCHERY_DRY_RUN_MAX_BYTES = env_int(
    "BATCHERY_DRY_RUN_MAX_BYTES",
    8 * 1024 * 1024,
    minimum=1,
    doc="A dry run reads at most this many bytes of the input as stored (compressed, if it is) per pass.",
)
BATCHERY_DRY_RUN_MAX_SECONDS = env_float(
    "BATCHERY_DRY_RUN_MAX_SECONDS",
    3.0,
    minimum=0.1,
    doc="A dry run stops reading its input after this many seconds, and extrapolates from what it read.",
)
BATCHERY_MAX_REPORTED_PROBLEMS = env_int(
    "BATCHERY_MAX_REPORTED_PROBLEMS", 20, minimum=1, doc="Bad lines named in one refusal."
)
# LoRA adapters a tenant registers: checked before anything is stored (safetensors only, shapes matching
# the base model), and bounded so that one tenant cannot fill the storage or a slot's memory with them.
BATCHERY_MAX_ADAPTER_BYTES = env_int(
    "BATCHERY_MAX_ADAPTER_BYTES",
    512 * 1024 * 1024,
    minimum=1,
    doc="The largest LoRA adapter (its weights file) a tenant may register.",
)
BATCHERY_MAX_LORA_RANK = env_int(
    "BATCHERY_MAX_LORA_RANK", 256, minimum=1, doc="The highest LoRA rank (r) an adapter may have."
)
BATCHERY_MAX_ADAPTERS_PER_JOB = env_int(
    "BATCHERY_MAX_ADAPTERS_PER_JOB", 64, minimum=1, doc="Distinct adapters the lines of one job may name."
)
# Each distinct name is held for the job's whole read; a line past the limit is refused, naming it.
BATCHERY_MAX_RECORD_MODEL_NAMES = env_int(
    "BATCHERY_MAX_RECORD_MODEL_NAMES",
    100,
    minimum=1,
    doc="Distinct `model` names (adapters and unknown names together) the lines of one job may give.",
)
# A slot compiles each distinct schema once (bounded by BATCHERY_GRAMMAR_COMPILE_TIMEOUT_S): this bounds how
# many one job may make it compile.
BATCHERY_MAX_JOB_SCHEMAS = env_int(
    "BATCHERY_MAX_JOB_SCHEMAS",
    32,
    minimum=1,
    doc="Distinct reply formats (a record's own `response_format` or `tools`) the lines of one job may give.",
)
# `/v1/batches` input files up to this size are validated within the create request; larger ones by a
# control task while the batch reads `validating`, so that no request outlives gunicorn's timeout.
BATCHERY_BATCH_SYNC_VALIDATION_BYTES = env_int(
    "BATCHERY_BATCH_SYNC_VALIDATION_BYTES",
    8 * 1024 * 1024,
    minimum=0,
    doc="A /v1/batches input file up to this size is validated within `create`; a larger one on the control queue.",
)
# A batch still validating this long after it was created, its task holding no lease, is sent to be
# validated again by the reconciler (its message was lost, or its worker died).
BATCHERY_BATCH_VALIDATION_RESEND_S = env_int(
    "BATCHERY_BATCH_VALIDATION_RESEND_S",
    600,
    minimum=1,
    doc="A batch left `validating` this long has its validation sent again by the sweep.",
)
# Default sharding (no shard_size given): the planner ends a shard before its estimated compute
# seconds (portal.catalog.throughput) would pass the target, and at the record bound whatever the
# estimate. A model that never ran is estimated at the default seconds a record. A job whose size
# is known at submission is cut in shards that shrink towards its end (its work left over this many
# shards a slot, down to the minimum; 0: none), so that it spreads over its class's slots and they
# end together.
BATCHERY_TARGET_SHARD_SECONDS = env_int(
    "BATCHERY_TARGET_SHARD_SECONDS", 60, minimum=1, doc="Estimated compute seconds of a shard cut by cost."
)
BATCHERY_MIN_SHARD_SECONDS = env_float(
    "BATCHERY_MIN_SHARD_SECONDS", 1.0, minimum=0.001, doc="The shortest shard the guided cut makes at a job's end."
)
BATCHERY_GUIDED_SHARDS_PER_SLOT = env_int(
    "BATCHERY_GUIDED_SHARDS_PER_SLOT",
    2,
    minimum=0,
    doc="A job of known size ends each shard at its work left over this many shards a spare slot (none with one "
    "spare slot or none, as on a busy fleet); 0 turns the shrinking off.",
)
# A job's first shard is cut at this many estimated seconds, each next one at twice the last up to
# the target: its first results come within a second whatever its size (0: every shard at the target).
# Small: the first shard is where the estimate is least known, and one learned from short records may
# be several times short of what long ones take. The doubling holds for as many shards as the job's
# queue has spare slots: on a busy fleet only the first shard is short.
BATCHERY_FIRST_SHARD_SECONDS = env_float(
    "BATCHERY_FIRST_SHARD_SECONDS",
    0.1,
    minimum=0.0,
    doc="A job cut by cost starts with a shard of this many estimated seconds, doubling up to the target for "
    "as many shards as its queue has spare slots (on a busy fleet, the first shard alone); 0 cuts every shard "
    "at the target.",
)
BATCHERY_MAX_SHARD_RECORDS = env_int(
    "BATCHERY_MAX_SHARD_RECORDS", 10_000, minimum=1, doc="The most records in a shard cut by cost."
)
# Prefix grouping (portal.execution.prefix_groups): the planner of a chat or generation job keeps the
# records whose prompts begin alike in the same shards, so that a prefix's KV cache is computed in a
# few shards instead of in every one. Records begin alike when their first BATCHERY_PREFIX_GROUP_CHARS
# characters are equal; a beginning forms a group when at least BATCHERY_PREFIX_GROUP_MIN_RECORDS
# records share it, and at most BATCHERY_PREFIX_MAX_GROUPS groups are formed (each holds a shard open
# while the planner writes). A grouped job's first shard starts once its input has been read.
BATCHERY_PREFIX_GROUPING = env_bool(
    "BATCHERY_PREFIX_GROUPING",
    True,
    doc="The planner groups the records of chat and generation jobs whose prompts begin alike into the same "
    "shards (a job's `prefix_reuse: false` turns it off for that job).",
)
BATCHERY_PREFIX_GROUP_CHARS = env_int(
    "BATCHERY_PREFIX_GROUP_CHARS",
    2000,
    minimum=1,
    doc="Characters of a prompt's beginning (a chat's messages before its last, or a prompt's text) whose "
    "equality puts records in one prefix group.",
)
BATCHERY_PREFIX_GROUP_MIN_RECORDS = env_int(
    "BATCHERY_PREFIX_GROUP_MIN_RECORDS",
    64,
    minimum=2,
    doc="The fewest records sharing a prompt beginning that form a prefix group; fewer stay in input order.",
)
BATCHERY_PREFIX_MAX_GROUPS = env_int(
    "BATCHERY_PREFIX_MAX_GROUPS",
    24,
    minimum=1,
    doc="The most prefix groups one job is planned in (the largest first): the planner holds a shard open for "
    "each, on S3 with a part's buffer (BATCHERY_S3_PART_BYTES).",
)
BATCHERY_DEFAULT_SECONDS_PER_RECORD = env_float(
    "BATCHERY_DEFAULT_SECONDS_PER_RECORD",
    0.05,
    minimum=0.0,
    doc="The cost estimate of a model that never ran and names no `seconds_per_record`.",
)

BATCHERY_CURRENCY = env_str(
    "BATCHERY_CURRENCY",
    "USD",
    doc="The ISO 4217 code of the one currency the deployment bills in: every price and budget is in it.",
)
if not re.fullmatch(r"[A-Z]{3}", BATCHERY_CURRENCY):
    raise ImproperlyConfiguredEnv(f"BATCHERY_CURRENCY must be an ISO 4217 code such as USD, not {BATCHERY_CURRENCY!r}")
BATCHERY_COST_ESTIMATE_FACTOR = env_float(
    "BATCHERY_COST_ESTIMATE_FACTOR",
    3.0,
    minimum=1.0,
    doc="How far a job's GPU-seconds and input tokens may land from the dry run's estimates: its cost bounds "
    "take them divided (low) and multiplied (high) by this.",
)

# An API key read from the database is kept by each portal process for at most this many seconds, and
# only while no key, membership, user or tenant has changed since (portal.tenancy.key_cache); 0: never.
BATCHERY_API_KEY_CACHE_S = env_float(
    "BATCHERY_API_KEY_CACHE_S",
    10.0,
    minimum=0.0,
    doc="How long a portal process keeps an API key it read; 0 reads it every request.",
)

# The API: keys for programs, sessions for the portal; one error shape; cursor pages.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.api.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["portal.api.permissions.TenantRolePermission"],
    "DEFAULT_PARSER_CLASSES": [
        "portal.api.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "portal.api.pagination.CreatedCursorPagination",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Batchery API",
    "DESCRIPTION": "Batch inference jobs, models, usage and API keys; plus an OpenAI-compatible Batch API under /v1/.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # The docs page's assets are served from here, not a CDN: deployments may have no internet.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # Several models have a `status`: each choice set keeps a name of its own in the schema.
    "ENUM_NAME_OVERRIDES": {"JobStatusEnum": "portal.jobs.models.JobStatus"},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "portal.api.schema.add_error_responses",
    ],
}
# Uploaded inputs (REST and /v1/files) larger than this are refused with 413.
BATCHERY_MAX_UPLOAD_BYTES = env_int(
    "BATCHERY_MAX_UPLOAD_BYTES",
    200 * 1024 * 1024,
    minimum=1,
    doc="The largest upload the API and the portal take (413 above).",
)
# Request bodies other than uploads (JSON, forms) larger than this are refused with 413 before they are read.
BATCHERY_MAX_REQUEST_BYTES = env_int(
    "BATCHERY_MAX_REQUEST_BYTES",
    10 * 1024 * 1024,
    minimum=1024,
    doc="The largest request body other than an upload (413 above, from its Content-Length).",
)
# A job's input cut into more shards than this fails at planning: each shard is a row, a message and a
# merge step, so one job must not flood the tables and queues every tenant shares.
BATCHERY_MAX_SHARDS_PER_JOB = env_int(
    "BATCHERY_MAX_SHARDS_PER_JOB",
    20_000,
    minimum=1,
    doc="The most shards one job may be cut into; planning fails a job that needs more.",
)
# The shortest `expires_after` / `output_expires_after` accepted: an hour, as at OpenAI; tests lower it.
BATCHERY_FILE_EXPIRY_MIN_SECONDS = env_int(
    "BATCHERY_FILE_EXPIRY_MIN_SECONDS", 3600, minimum=1, doc="The shortest `expires_after` a /v1/ file may ask for."
)
# Storage URI prefixes every tenant's API callers may read job inputs from, besides their uploads and
# their tenant's `storage_prefixes` (comma-separated, e.g. "file:///srv/datasets,s3://datasets").
BATCHERY_INPUT_ROOTS = env_list(
    "BATCHERY_INPUT_ROOTS", [], doc="URI prefixes API callers may name as `input_uri` besides their uploads."
)
# Presigned download links (S3) stay valid this long.
BATCHERY_PRESIGNED_URL_EXPIRES_S = env_int(
    "BATCHERY_PRESIGNED_URL_EXPIRES_S", 900, minimum=1, doc="Lifetime of a presigned download URL of an S3 output."
)
# Uploads above this size spill from memory to a temporary file while they are received.
FILE_UPLOAD_MAX_MEMORY_SIZE = 8 * 1024 * 1024
# Flower, linked from the fleet pages for staff only: the address staff's browsers reach it at (it
# may differ from where it listens, behind a proxy). `manage.py up` points it at its own Flower.
BATCHERY_FLOWER_URL = env_str(
    "BATCHERY_FLOWER_URL", "http://127.0.0.1:5555/", doc="The Flower link staff see in the portal."
)


def _retry_delays(name: str, default: list[str], *, doc: str) -> tuple[float, ...]:
    raw = env_list(name, default, doc=doc)
    try:
        delays = tuple(float(value) for value in raw)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={','.join(raw)!r} is not a list of seconds") from None
    if any(delay < 0 for delay in delays):
        raise ImproperlyConfiguredEnv(f"{name}: delays may not be negative")
    return delays


# Webhooks (portal.webhooks). Deliveries go to public addresses only: a URL whose host resolves to a
# loopback, link-local, private or reserved address is refused unless its host (or host:port) is
# listed here (comma-separated, e.g. "127.0.0.1:9000,hooks.internal"). A failed delivery is tried
# again after each delay in turn (seconds), then given up; `job.progress` goes out at most this often per job.
BATCHERY_WEBHOOK_ALLOWED_HOSTS = [
    host.lower()
    for host in env_list(
        "BATCHERY_WEBHOOK_ALLOWED_HOSTS",
        [],
        doc="Hosts (or host:port) webhooks may reach although they resolve to private, loopback or reserved addresses.",
    )
]
BATCHERY_WEBHOOK_RETRY_DELAYS_S = _retry_delays(
    "BATCHERY_WEBHOOK_RETRY_DELAYS_S",
    ["5", "30", "120", "600", "1800", "7200", "21600"],
    doc="Seconds before each retry of a failed webhook delivery; one attempt more than delays, then it is given up.",
)
BATCHERY_WEBHOOK_TIMEOUT_S = env_float(
    "BATCHERY_WEBHOOK_TIMEOUT_S", 10.0, minimum=0.1, doc="Connect and read timeout of each webhook attempt."
)
# Webhook deliveries run on their own queue (`webhooks`); a receiver can hold a sender no longer than
# the attempt's deadline, and a tenant no more senders than its places in flight.
BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S = env_float(
    "BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S",
    15.0,
    minimum=0.1,
    doc="Overall deadline of one webhook attempt (connect, send, read the answer's head), however slowly "
    "the receiver answers.",
)
BATCHERY_WEBHOOK_RESOLVE_TIMEOUT_S = env_float(
    "BATCHERY_WEBHOOK_RESOLVE_TIMEOUT_S",
    2.0,
    minimum=0.1,
    doc="How long registering a webhook endpoint waits for its host name to resolve before it is refused as "
    "unresolved (a delivery's look-up is within its attempt's deadline).",
)
BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT = env_int(
    "BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT",
    2,
    minimum=1,
    doc="Webhook attempts of one tenant in flight at once; its further deliveries wait (delayed, not lost).",
)
BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT = env_int(
    "BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT",
    20,
    minimum=1,
    doc="Webhook endpoints one tenant may register; one more is refused (400).",
)
BATCHERY_WEBHOOK_PROGRESS_EVERY_S = env_float(
    "BATCHERY_WEBHOOK_PROGRESS_EVERY_S",
    30.0,
    minimum=0.001,
    doc="A native job sends `job.progress` at most this often.",
)


# --- Throttles on failed sign-ins and failed API keys (issue 39) ---
# Portal and admin sign-ins go through django-axes: after BATCHERY_LOGIN_FAILURE_LIMIT failures from one
# client address, or for one user name, further attempts get 429 with Retry-After until the cool-off has
# passed. Its counts live in Redis (the "throttle" cache), so every gunicorn worker sees the same ones.
INSTALLED_APPS.append("axes")
# Last, as axes asks: it turns a sign-in it refused into the 429 page.
MIDDLEWARE.append("axes.middleware.AxesMiddleware")
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "throttle": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": progress_redis_url(),
        "KEY_PREFIX": "batchery:throttle",
        "OPTIONS": {"socket_timeout": 5, "socket_connect_timeout": 5},
    },
}
BATCHERY_LOGIN_FAILURE_LIMIT = env_int(
    "BATCHERY_LOGIN_FAILURE_LIMIT",
    10,
    minimum=1,
    doc="Failed portal or admin sign-ins from one client address, or for one user name, before they get 429.",
)
BATCHERY_LOGIN_COOLOFF_S = env_int(
    "BATCHERY_LOGIN_COOLOFF_S",
    900,
    minimum=1,
    doc="Seconds a throttled sign-in waits (its Retry-After); each failure meanwhile starts it again.",
)
BATCHERY_TRUSTED_PROXIES = env_int(
    "BATCHERY_TRUSTED_PROXIES",
    0,
    minimum=0,
    doc="Proxies in front of the portal whose X-Forwarded-For names the client address the throttles count "
    "by; 0 counts by the connection's address.",
)
AXES_ENABLED = True
AXES_HANDLER = "axes.handlers.cache.AxesCacheHandler"
AXES_CACHE = "throttle"
AXES_FAILURE_LIMIT = BATCHERY_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(seconds=BATCHERY_LOGIN_COOLOFF_S)
# Either one counts: by address (one machine trying many names) and by name (many machines trying one).
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]
AXES_RESET_ON_SUCCESS = True
# The counts live in the cache, not in axes's tables: its admin pages would show nothing.
AXES_ENABLE_ADMIN = False
AXES_LOCKOUT_CALLABLE = "portal.web.views.auth.signin_throttled"
AXES_IPWARE_PROXY_COUNT = BATCHERY_TRUSTED_PROXIES or None
AXES_IPWARE_META_PRECEDENCE_ORDER = (
    ("HTTP_X_FORWARDED_FOR", "REMOTE_ADDR") if BATCHERY_TRUSTED_PROXIES else ("REMOTE_ADDR",)
)

# API keys (REST and OpenAI-compatible): only failed attempts count, by client address and by the key's
# prefix; a valid key is never refused by them, so a tenant sharing an address with an attacker goes on.
BATCHERY_API_KEY_FAILURE_LIMIT = env_int(
    "BATCHERY_API_KEY_FAILURE_LIMIT",
    20,
    minimum=1,
    doc="Failed API-key attempts from one client address (or on one key prefix) in a window before further "
    "failures get 429.",
)
BATCHERY_API_KEY_FAILURE_WINDOW_S = env_int(
    "BATCHERY_API_KEY_FAILURE_WINDOW_S",
    300,
    minimum=1,
    doc="The window (seconds) over which failed API-key attempts are counted; a throttled client's Retry-After "
    "is what is left of it.",
)

# --- Invitations (issue 39): a tenant admin's invitation waits this long for the invitee's answer. ---
BATCHERY_INVITATION_EXPIRY_DAYS = env_int(
    "BATCHERY_INVITATION_EXPIRY_DAYS",
    14,
    minimum=1,
    doc="Days an invitation to a tenant waits for the invited person to accept or decline it.",
)
BATCHERY_MAX_PENDING_INVITATIONS = env_int(
    "BATCHERY_MAX_PENDING_INVITATIONS",
    100,
    minimum=1,
    doc="Invitations one tenant may have waiting for an answer at once.",
)
