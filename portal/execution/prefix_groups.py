"""Prefix groups: which records of a chat or generation job the planner keeps together because their
prompts begin alike, so that a shared system prompt's KV cache is computed in a few shards, not in
every one (`gpuworkers.engines.prefix_reuse` reuses it within a shard).

A record's prefix key is a hash of the beginning of its prompt, in characters (the planner holds no
tokenizer): for chat, the messages before the last one (the system prompt, a few-shot preamble), role
and text, cut at BATCHERY_PREFIX_GROUP_CHARS, or the only message's first that many characters; for a
prompt, its first that many characters. The record's adapter (`model`) is part of the key: a prefix's
cache belongs to one adapter. Records whose prompts share a beginning shorter than the cut get
different keys and stay ungrouped: grouping only ever reorders work, never changes an output line.

`PrefixCounter` finds the frequent keys in one pass over the input in bounded memory (Misra-Gries),
and `PrefixGrouping` is what the planner acts on: the groups chosen, the largest first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from portal.jobs.models import Job
from tasks.shared.formats.records import TASK_INPUT_FIELDS, Record

GROUPED_TASKS = ("chat", "generate")
"""Tasks whose prompts an engine may share a prefix's KV cache across: embeddings and classification
read each input whole once, so keeping their records together would gain nothing."""
COUNTERS = 1024
"""Keys `PrefixCounter` holds at once: every key held by more than 1/1025 of the records is found."""
PROBE_RECORDS = 10_000
"""The counting pass gives up after this many records if no key has reached a group's size by then: a
job whose prompts share no beginning pays for reading this many records twice, not its whole input."""

PrefixKey = Callable[[Record], int]


def prefix_key_for(job: Job) -> PrefixKey | None:
    """The job's prefix key, or None where the job is not grouped: grouping is off
    (BATCHERY_PREFIX_GROUPING), the job turned prefix reuse off (`prefix_reuse: false`, read as the
    engines read it), or its task does not generate."""
    if not settings.BATCHERY_PREFIX_GROUPING or job.model.task not in GROUPED_TASKS:
        return None
    if job.params.get("prefix_reuse") is False:
        return None
    chars = settings.BATCHERY_PREFIX_GROUP_CHARS
    field = TASK_INPUT_FIELDS[job.model.task]

    def key(record: Record) -> int:
        return prefix_key(record.data.get(field), chars=chars, adapter=str(record.data.get("model") or ""))

    return key


def prefix_key(value: Any, *, chars: int, adapter: str = "") -> int:
    """The key of a record whose input is `value` (a prompt, or chat messages): a 64-bit hash of its
    beginning, `chars` characters of it."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(adapter.encode())
    digest.update(b"\0")
    digest.update(_beginning(value, chars).encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest(), "little")


def _beginning(value: Any, chars: int) -> str:
    if isinstance(value, str):
        return value[:chars]
    if not isinstance(value, list) or not value:
        return ""
    # The last message is the one that varies; a lone message may still begin with shared instructions.
    messages = value[:-1] or value
    parts: list[str] = []
    length = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        # Role and text, separated by characters a prompt does not hold: "ab"+"c" is not "a"+"bc".
        text = f"{message.get('role', '')}\x1f{_text_of(message.get('content'))}\x1e"
        parts.append(text)
        length += len(text)
        if length >= chars:
            break
    return "".join(parts)[:chars]


def _text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


class PrefixCounter:
    """Counts keys in one pass in O(COUNTERS) memory (Misra-Gries): a key counted past a full table
    takes one from every key held, dropping those at zero. Every key held by more than
    records / (COUNTERS + 1) records is held at the end, its count short by at most that many."""

    def __init__(self, counters: int = COUNTERS) -> None:
        self._counters = counters
        self.counts: dict[int, int] = {}
        self.records = 0

    def add(self, key: int) -> None:
        self.records += 1
        counts = self.counts
        if key in counts:
            counts[key] += 1
        elif len(counts) < self._counters:
            counts[key] = 1
        else:
            # Each such step takes COUNTERS + 1 from the total counted: O(1) a record, amortized.
            self.counts = {held: count - 1 for held, count in counts.items() if count > 1}

    def largest(self) -> int:
        return max(self.counts.values(), default=0)


@dataclass(frozen=True)
class PrefixGrouping:
    """The groups a job is planned in: each group's records go to shards of their own."""

    groups: dict[int, int]
    """Prefix key -> group number (0 for the largest group)."""
    key: PrefixKey

    def group_of(self, record: Record) -> int | None:
        """The record's group, None for a record planned among the ungrouped ones."""
        return self.groups.get(self.key(record))


def prefix_grouping(key: PrefixKey, records: Iterable[Record]) -> PrefixGrouping | None:
    """Count the keys of `records` (the job's input, in order) and choose its groups (`frequent_keys`)."""
    groups = frequent_keys(key(record) for record in records)
    return PrefixGrouping(groups=groups, key=key) if groups else None


def frequent_keys(keys: Iterable[int]) -> dict[int, int]:
    """The groups of a job whose records' prefix keys are `keys`, in input order: the keys shared by at
    least BATCHERY_PREFIX_GROUP_MIN_RECORDS records, the largest BATCHERY_PREFIX_MAX_GROUPS of them,
    each with its group number (0 for the largest). Empty where grouping would change nothing: no
    group, or one group holding every record. Stops reading after PROBE_RECORDS keys while none has
    reached a group's size."""
    least = settings.BATCHERY_PREFIX_GROUP_MIN_RECORDS
    counter = PrefixCounter()
    for key in keys:
        counter.add(key)
        if counter.records == PROBE_RECORDS and counter.largest() < least:
            return {}
    frequent = sorted(
        ((count, held) for held, count in counter.counts.items() if count >= least),
        key=lambda item: (-item[0], item[1]),
    )[: settings.BATCHERY_PREFIX_MAX_GROUPS]
    if not frequent or (len(frequent) == 1 and frequent[0][0] == counter.records):
        return {}
    return {held: number for number, (_, held) in enumerate(frequent)}
