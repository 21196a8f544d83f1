"""What a dry run may read of its input (the operator's BATCHERY_DRY_RUN_MAX_*), and the streams that
count every read against it; `portal.jobs.services.dry_run` extrapolates from what they let through."""

from __future__ import annotations

import io
import time
from typing import TYPE_CHECKING, BinaryIO, cast

from django.conf import settings

from portal.execution.plan import InputPosition

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


class SampleEnds(Exception):
    """The dry run's budget is spent: the prefix read so far is its sample."""


class SampleBudget:
    """What a dry run may read: records, bytes of the input as stored and seconds (the operator's
    BATCHERY_DRY_RUN_MAX_*), shared by its passes; `stopped_by` names the limit that ended one."""

    def __init__(self) -> None:
        self.max_records: int = settings.BATCHERY_DRY_RUN_MAX_RECORDS
        self.max_bytes: int = settings.BATCHERY_DRY_RUN_MAX_BYTES
        self._deadline = time.monotonic() + settings.BATCHERY_DRY_RUN_MAX_SECONDS
        self.stopped_by: str | None = None

    def spend(self, *, records: int = 0, read: int = 0) -> None:
        """Raise `SampleEnds` once `records` read or `read` bytes, or the time, pass their limit."""
        if records > self.max_records:
            self._stop("BATCHERY_DRY_RUN_MAX_RECORDS")
        if read > self.max_bytes:
            self._stop("BATCHERY_DRY_RUN_MAX_BYTES")
        if time.monotonic() > self._deadline:
            self._stop("BATCHERY_DRY_RUN_MAX_SECONDS")

    def _stop(self, setting: str) -> None:
        self.stopped_by = setting
        raise SampleEnds(setting)


class _Metered(io.RawIOBase):
    """The input as the dry run reads it: every read counted and held to the budget."""

    def __init__(self, raw: BinaryIO, budget: SampleBudget) -> None:
        super().__init__()
        self._raw = raw
        self._budget = budget
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._raw.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._budget.spend(read=self.read_bytes)
        view = memoryview(buffer).cast("B")
        data = self._raw.read(min(len(view), self._budget.max_bytes + 1 - self.read_bytes))
        view[: len(data)] = data
        self.read_bytes += len(data)
        return len(data)

    def close(self) -> None:
        self._raw.close()
        super().close()


class MeteredPosition(InputPosition):
    """Follows a pass like `InputPosition`, through a `_Metered` stream; `read_bytes` sums every stream it opened."""

    def __init__(self, budget: SampleBudget) -> None:
        super().__init__()
        self._budget = budget
        self._streams: list[_Metered] = []

    def track(self, stream: BinaryIO) -> BinaryIO:
        metered = _Metered(stream, self._budget)
        self._streams.append(metered)
        return super().track(cast(BinaryIO, io.BufferedReader(metered)))

    @property
    def read_bytes(self) -> int:
        return sum(stream.read_bytes for stream in self._streams)
