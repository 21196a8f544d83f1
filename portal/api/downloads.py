"""Streaming a stored object to the client without holding it in memory."""

from __future__ import annotations

from collections.abc import Iterator

from django.http import StreamingHttpResponse
from rest_framework.renderers import BaseRenderer, JSONRenderer

from portal.jobs.services.partial import PartialOutput
from tasks.shared.storage import store_for

CHUNK_BYTES = 256 * 1024


def stream_object(uri: str, *, filename: str, content_type: str = "application/jsonl") -> StreamingHttpResponse:
    """A response streaming the object at `uri`; raises StorageError before any byte if it is missing."""
    store = store_for(uri)
    size = store.size(uri)
    source = store.open_read(uri)

    def chunks() -> Iterator[bytes]:
        try:
            while chunk := source.read(CHUNK_BYTES):
                yield chunk
        finally:
            source.close()

    response = StreamingHttpResponse(chunks(), content_type=content_type)
    response["Content-Length"] = str(size)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def stream_partial(partial: PartialOutput, *, filename: str) -> StreamingHttpResponse:
    """A response streaming a job's partial output (JSONL), its counts in headers; its length is not
    known ahead (that would cost a storage request per shard), so it goes without one."""
    response = StreamingHttpResponse(partial.chunks(), content_type="application/jsonl")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["X-Batchery-Partial-Shards"] = str(partial.shards)
    response["X-Batchery-Partial-Records"] = str(partial.records)
    response["X-Batchery-Partial-Complete"] = "true" if partial.complete else "false"
    return response


class AnyMediaRenderer(JSONRenderer):
    """Lets download views answer any Accept header (clients ask for `application/binary` and the
    like); what it renders itself is only the JSON of an error."""

    media_type = "*/*"
    format = "download"


DOWNLOAD_RENDERERS: list[type[BaseRenderer]] = [JSONRenderer, AnyMediaRenderer]
