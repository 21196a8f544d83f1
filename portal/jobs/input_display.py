"""Names as a tenant sees them: never the platform's storage root, its local folders, another tenant's
number, or where the operators keep a model's weights.

Uploads are stored under the platform's storage (BATCHERY_STORAGE_URL, `uploads/<tenant>/`), and an
OpenAI batch's converted input under `batches/<id>/`; the whole URI would show tenants the
platform's bucket and layout. Inputs the platform stored are shown relative to it (`upload://<name>`
for an upload, which a submission accepts back as its input, `batchery://<path>` for the rest); an
input the tenant named (their own `s3://` URI, a `file://` path under an input root) is shown as
given. A model's or an adapter's source is shown as its catalog name (`<model name@version>`). Every
tenant-visible answer that carries such a name (the job API, the manifest, the portal's job page, the
OpenAI and Anthropic batches and their results) goes through here. Operators see the stored values in
the admin.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from django.conf import settings

from portal.jobs.models import Job
from portal.tenancy.stored_files import uploads_root

UPLOAD_SCHEME = "upload://"
"""How tenants see and name their uploads: `upload://<name>`, never the platform's storage root."""
STORED_SCHEME = "batchery://"
"""How tenants see what the platform stored for them that is no upload (`batchery://<path>`)."""


def _local_path(uri: str) -> str | None:
    """The folder a `file://` URI names, or None for another scheme."""
    parsed = urlparse(uri)
    return unquote(parsed.path).rstrip("/") if parsed.scheme == "file" else None


def hide_storage_root(text: str) -> str:
    """`text` (an error message) with every stored URI below the platform's storage root written as a tenant
    sees it: `upload://<name>` for an upload, `batchery://<path>` for the rest; the storage's local folder
    (a `file://` storage, as a local error names it) and the platform's own folder (BATCHERY_VAR_DIR) too."""
    root = settings.BATCHERY_STORAGE_URL.rstrip("/")
    forms = [root]
    if (folder := _local_path(root)) is not None:
        forms.append(folder)
    for form in forms:
        escaped = re.escape(form)
        text = re.sub(rf"{escaped}/uploads/\d+/", UPLOAD_SCHEME, text)
        text = re.sub(rf"{escaped}/", STORED_SCHEME, text)
    var_dir = str(Path(settings.VAR_DIR)).rstrip("/")
    return text.replace(var_dir + "/", STORED_SCHEME) if var_dir else text


def _sources(job: Job) -> list[tuple[str, str]]:
    """The operators' places of the job's model and adapters, each with the name its tenant knows it by,
    longest first (an adapter kept below its model's folder is named as the adapter)."""
    found = [(job.model.source, f"<{job.model.name}@{job.model.version}>")]
    for name, entry in (job.adapters or {}).items():
        spec = entry.get("spec", {})
        found.append((str(spec.get("source", "")), f"<{name}@{spec.get('version', '')}>"))
    return sorted(((source, name) for source, name in found if len(source) > 1), key=lambda pair: -len(pair[0]))


def tenant_text(text: str, *, job: Job) -> str:
    """`text` (an error of the job or of one of its shards) as the job's tenant is shown it: no storage root
    or platform folder (`hide_storage_root`), and the model's and adapters' sources as their names."""
    for source, name in _sources(job):
        text = text.replace(source.rstrip("/"), name)
    return hide_storage_root(text)


def shown_input_uri(uri: str, *, tenant_id: int) -> str:
    """`uri` as tenant `tenant_id` is shown it."""
    uploaded = _under(uri, uploads_root(tenant_id))
    if uploaded is not None:
        return UPLOAD_SCHEME + uploaded
    stored = _under(uri, settings.BATCHERY_STORAGE_URL)
    if stored is not None:
        return STORED_SCHEME + stored
    return uri


def _under(uri: str, root: str) -> str | None:
    """The path of `uri` below `root`, or None when it is not below it (`root` ends at a path boundary)."""
    prefix = root.rstrip("/") + "/"
    return uri[len(prefix) :] if uri.startswith(prefix) else None


def tenant_input_uri(job: Job) -> str:
    """The job's input as its tenant's pages and API show it."""
    return shown_input_uri(job.input_uri, tenant_id=job.tenant_id)


def tenant_job_error(job: Job) -> str:
    """The job's error as its tenant sees it (`tenant_text`)."""
    return tenant_text(job.error, job=job) if job.error else ""


def _stored_file(uri: str, *, job: Job) -> str:
    """One of the job's own files (output, error file) as its tenant is shown it: below the job's folder,
    wherever the storage was when the job was made (`storage_layout.job_root`)."""
    return f"{STORED_SCHEME}jobs/{job.pk}/{uri.rsplit('/', 1)[-1]}" if uri else ""


def tenant_manifest(manifest: dict[str, Any], *, job: Job) -> dict[str, Any]:
    """The job's manifest as its tenant reads it (the API, the portal, `manifest.json`): its input and files
    as `tenant_input_uri` shows them, and no model or adapter source (the operators' places of the weights;
    the digests say which weights ran). The same for a manifest already in that form."""
    shown = dict(manifest)
    if "model" in shown:
        shown["model"] = {key: value for key, value in shown["model"].items() if key != "source"}
    if "adapters" in shown:
        shown["adapters"] = {
            name: {key: value for key, value in entry.items() if key != "source"}
            for name, entry in shown["adapters"].items()
        }
    if "uri" in shown.get("input", {}):
        shown["input"] = {**shown["input"], "uri": shown_input_uri(job.input_uri, tenant_id=job.tenant_id)}
    files = {"uri": job.output_uri, "errors_uri": job.errors_uri}
    if "output" in shown:
        shown["output"] = {
            key: _stored_file(files[key], job=job) if key in files else value for key, value in shown["output"].items()
        }
    return shown
