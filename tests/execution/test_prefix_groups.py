"""Prefix keys and the choice of groups, without a database: what makes two prompts begin alike, and
which beginnings are frequent enough to be kept together."""

from __future__ import annotations

from typing import Any

from portal.execution.prefix_groups import COUNTERS, PrefixCounter, prefix_grouping, prefix_key
from tasks.shared.formats.records import Record

SYSTEM = "You are a careful assistant. " * 10


def chat(system: str, question: str, *, few_shot: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    if few_shot:
        messages += [{"role": "user", "content": few_shot}, {"role": "assistant", "content": "ok"}]
    return [*messages, {"role": "user", "content": question}]


def test_chats_that_differ_only_in_their_last_message_share_a_key() -> None:
    assert prefix_key(chat(SYSTEM, "one?"), chars=2000) == prefix_key(chat(SYSTEM, "two?"), chars=2000)
    assert prefix_key(chat(SYSTEM, "one?"), chars=2000) != prefix_key(chat(SYSTEM + "!", "one?"), chars=2000)
    assert prefix_key(chat(SYSTEM, "q", few_shot="a"), chars=2000) != prefix_key(chat(SYSTEM, "q"), chars=2000)


def test_only_the_first_chars_count_and_the_adapter_does() -> None:
    long_system = "x" * 3000
    assert prefix_key(chat(long_system + "A", "q"), chars=2000) == prefix_key(chat(long_system + "B", "q"), chars=2000)
    assert prefix_key("p" * 50 + "tail one", chars=50) == prefix_key("p" * 50 + "tail two", chars=50)
    assert prefix_key("same", chars=50, adapter="a") != prefix_key("same", chars=50, adapter="b")


def test_text_parts_count_and_role_boundaries_are_kept() -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "abc"}]}, {"role": "user", "content": "q"}]
    plain = [{"role": "system", "content": "abc"}, {"role": "user", "content": "q"}]
    assert prefix_key(parts, chars=100) == prefix_key(plain, chars=100)
    split_one = [
        {"role": "system", "content": "ab"},
        {"role": "system", "content": "c"},
        {"role": "user", "content": "q"},
    ]
    split_two = [
        {"role": "system", "content": "a"},
        {"role": "system", "content": "bc"},
        {"role": "user", "content": "q"},
    ]
    assert prefix_key(split_one, chars=100) != prefix_key(split_two, chars=100)


def test_the_counter_finds_every_key_above_its_share_in_bounded_memory() -> None:
    counter = PrefixCounter()
    for n in range(50_000):
        counter.add(n % 7 if n % 2 else 1_000_000 + n)  # seven frequent keys among 25,000 unique ones
        assert len(counter.counts) <= COUNTERS
    for key in range(7):
        held = sum(1 for n in range(1, 50_000, 2) if n % 7 == key)  # about 3,571
        assert held - 50_000 // (COUNTERS + 1) <= counter.counts[key] <= held


def records(keys: list[int]) -> list[Record]:
    return [Record(line=n + 1, custom_id=str(n + 1), data={"prompt": f"k{key}"}) for n, key in enumerate(keys)]


def key_of(record: Record) -> int:
    return int(record.data["prompt"][1:])


def test_groups_are_the_largest_frequent_keys_up_to_the_most_allowed(settings: Any) -> None:
    settings.BATCHERY_PREFIX_GROUP_MIN_RECORDS = 3
    settings.BATCHERY_PREFIX_MAX_GROUPS = 2
    grouping = prefix_grouping(key_of, records([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 1, 9, 8]))

    assert grouping is not None
    assert grouping.groups == {1: 0, 2: 1}, "3 is frequent too, but only the two largest form groups"


def test_no_group_where_grouping_would_change_nothing(settings: Any) -> None:
    settings.BATCHERY_PREFIX_GROUP_MIN_RECORDS = 3
    assert prefix_grouping(key_of, records([1, 2, 3, 4, 5, 6])) is None, "no key is frequent"
    assert prefix_grouping(key_of, records([7] * 10)) is None, "one group would hold every record"
    assert prefix_grouping(key_of, records([7] * 10 + [8])) is not None
