"""What this worker process is doing now, for its heartbeat: the shard it runs, if any."""

from __future__ import annotations

current_shard: str | None = None
"""`<job id>/<shard index>` while a shard attempt runs in this process."""
