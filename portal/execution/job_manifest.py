"""A job's provenance manifest: how its output was made, joined at the merge from its committed shards'
records (`ShardManifest.provenance`, written by the slots that ran them) and the job's own.

It names the model's catalog name and version, the digest of its weights and of its tokenizer as the
slots resolved them (every file's), the engine and the software's versions, the job's parameters and the
digest of every set of per-record parameters, the seed, the input's digest and record count,
Batchery's version, and the GPU classes and hosts that ran it. It is written beside the output
(`manifest.json`) and kept on the job (`Job.provenance`) for the API, the portal and the admin, in the form
its tenant reads it (`input_display.tenant_manifest`): the input and files by the names the job API shows,
no storage root, and no model or adapter source (the shards' rows keep those for the operators).

The shards' provenance is read from their rows (settling keeps all of a commit's but the file list), and
the file list from one commit marker a weights digest: a merge reads no more markers than it did.

Shards whose slots held different weights under one model name make the job fail (`MixedWeights`),
unless the operator allows it (BATCHERY_ALLOW_MIXED_WEIGHTS): the manifest then says so and lists each.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections import Counter, defaultdict
from typing import Any

import orjson
from django.conf import settings

from portal.execution.settle import read_manifest
from portal.execution.shard_outcomes import ShardOutcome
from portal.jobs.input_display import tenant_manifest
from portal.jobs.models import Job, Shard, ShardStatus
from portal.jobs.storage_layout import job_root
from tasks.shared.digests import canonical_digest
from tasks.shared.specs import ShardManifest
from tasks.shared.storage import join_uri, store_for

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


class MixedWeights(Exception):
    """The job's shards ran on different weights of its model, which the operator does not allow."""


def manifest_uri(job: Job) -> str:
    return join_uri(job_root(job), MANIFEST_NAME)


def job_manifest(job: Job, outcomes: list[ShardOutcome], *, stopped: bool = False) -> dict[str, Any]:
    """The job's manifest, from the provenance its succeeded shards' rows keep (every round's: a retry keeps
    the lines of the shards before it; settled before this is called), and the model's file list from one
    commit marker a weights digest (one of `outcomes`, the markers the merge read, where it can); raises
    `MixedWeights` where its slots held different weights and that is not allowed (a `stopped` job, whose
    output is what it is, is only marked)."""
    rows = list(
        job.shards.filter(status=ShardStatus.SUCCEEDED)
        .order_by("round", "index")
        .only("pk", "index", "prefix_uri", "record_count", "provenance")
    )
    records = [row.provenance for row in rows if row.provenance]
    read = {outcome.shard.pk: outcome.manifest for outcome in outcomes if outcome.manifest is not None}
    weights = _weights(records)
    mixed = len(weights) > 1
    if mixed and not (settings.BATCHERY_ALLOW_MIXED_WEIGHTS or stopped):
        found = "; ".join(
            f"{entry['digest']} ({entry['shards']} shards on {', '.join(entry['hosts'])})" for entry in weights
        )
        raise MixedWeights(
            f"the shards of model {job.model.name}@{job.model.version} ran on different weights: {found} "
            "(BATCHERY_ALLOW_MIXED_WEIGHTS accepts such a job, marked)"
        )
    model = job.model
    first = weights[0] if weights else {}
    files = _files(first.get("digest", ""), rows, read)
    params = {**model.default_params, **job.params}
    overrides: Counter[str] = Counter()
    for record in records:
        overrides.update(record.get("record_params", {}))
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "job": {"id": str(job.id), "created_at": job.created_at.isoformat(), "retry_round": job.retry_round},
        "batchery_version": _version("batchery"),
        "model": {
            "name": model.name,
            "version": model.version,
            "task": model.task,
            "gpus_per_replica": model.gpus_per_replica,
            "pinned_digest": job.model_digest,
            "weights_digest": first.get("digest", ""),
            "tokenizer_digest": first.get("tokenizer_digest", ""),
            "files": files,
        },
        "mixed_weights": mixed,
        "weights": [
            {key: entry[key] for key in ("digest", "tokenizer_digest", "shards", "hosts")} for entry in weights
        ],
        "adapters": {
            name: {
                "version": entry["spec"]["version"],
                "rank": entry["spec"]["rank"],
            }
            for name, entry in sorted((job.adapters or {}).items())
        },
        "engine": {"name": model.engine, "versions": _versions(records)},
        "params": params,
        "params_digest": canonical_digest(params),
        "record_params": {"records": sum(overrides.values()), "digests": dict(sorted(overrides.items()))},
        "seed": params.get("seed"),
        "input": {
            "uri": job.input_uri,
            "format": job.input_format,
            "bytes": job.input_bytes,
            "digest": job.input_digest,
            "records": job.total_records,
        },
        "output": {"uri": job.output_uri, "errors_uri": job.errors_uri, "format": job.output_format},
        "gpu_classes": sorted({record["gpu_class"] for record in records if record.get("gpu_class")}),
        "hosts": sorted({record["host"] for record in records if record.get("host")}),
        "devices": sorted({record["device"] for record in records if record.get("device")}),
        "shards": job.shards.count(),
        "shards_without_provenance": len(rows) - len(records),
    }
    return tenant_manifest(manifest, job=job)


def job_manifest_write(job: Job, manifest: dict[str, Any]) -> None:
    """Write the manifest beside the job's output and keep it on the job's row."""
    uri = manifest_uri(job)
    with store_for(uri).open_write(uri) as out:
        out.write(orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    Job.objects.filter(pk=job.pk).update(provenance=manifest)
    job.provenance = manifest


def _weights(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct weights the shards ran on (an unknown digest, from an engine with no files, aside), most
    shards first, each with its shards' count and hosts."""
    found: dict[str, dict[str, Any]] = {}
    hosts: dict[str, set[str]] = defaultdict(set)
    for record in records:
        model = record.get("model", {})
        digest = model.get("weights_digest", "")
        if not digest:
            continue
        entry = found.setdefault(digest, {"digest": digest, "tokenizer_digest": model.get("tokenizer_digest", "")})
        entry["shards"] = entry.get("shards", 0) + 1
        hosts[digest].add(record.get("host", ""))
    for digest, entry in found.items():
        entry["hosts"] = sorted(hosts[digest])
    return sorted(found.values(), key=lambda entry: (-entry["shards"], entry["digest"]))


def _files(digest: str, rows: list[Shard], read: dict[Any, ShardManifest]) -> dict[str, str]:
    """The model's files by digest, from the commit marker of one shard that ran on `digest` (one the merge
    read already where there is one: a row keeps no file list)."""
    holders = [row for row in rows if row.provenance.get("model", {}).get("weights_digest") == digest]
    if not digest or not holders:
        return {}
    known = next((read[row.pk] for row in holders if row.pk in read), None)
    manifest = known or read_manifest(holders[0])
    return dict(manifest.provenance.get("model", {}).get("files", {})) if manifest else {}


def _versions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct sets of software versions the shards ran with, most shards first, with their counts."""
    counted = Counter(canonical_json(record.get("versions", {})) for record in records)
    return [{"versions": json.loads(versions), "shards": count} for versions, count in counted.most_common()]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
