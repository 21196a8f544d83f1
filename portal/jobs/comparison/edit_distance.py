"""Levenshtein distance between two texts, by Hyyrö's bit-parallel form of Myers' algorithm: one pass over
the second text, each step a few operations on integers as wide as the first (Python's integers grow),
so two texts of a few thousand characters compare in about a millisecond, not the seconds a cell-by-cell
table takes in Python. No library of the environment provides it."""

from __future__ import annotations


def levenshtein(a: str, b: str) -> int:
    """The fewest insertions, deletions and substitutions of characters that turn `a` into `b`."""
    if not a:
        return len(b)
    if not b:
        return len(a)
    masks: dict[str, int] = {}
    for i, char in enumerate(a):
        masks[char] = masks.get(char, 0) | (1 << i)
    full = (1 << len(a)) - 1
    top = 1 << (len(a) - 1)
    plus, minus, distance = full, 0, len(a)
    for char in b:
        equal = masks.get(char, 0)
        vertical = equal | minus
        horizontal = (((equal & plus) + plus) ^ plus) | equal
        horizontal_plus = minus | (~(horizontal | plus) & full)
        horizontal_minus = plus & horizontal
        if horizontal_plus & top:
            distance += 1
        elif horizontal_minus & top:
            distance -= 1
        # The first row grows by one a column (the distance from the empty prefix of `a`): hence the `| 1`.
        horizontal_plus = ((horizontal_plus << 1) | 1) & full
        horizontal_minus = (horizontal_minus << 1) & full
        plus = horizontal_minus | (~(vertical | horizontal_plus) & full)
        minus = horizontal_plus & vertical
    return distance


def normalised_edit_distance(a: str, b: str) -> float:
    """`levenshtein(a, b)` over the longer text's length: 0 for equal texts, 1 for texts sharing nothing in
    place; 0 for two empty texts."""
    longer = max(len(a), len(b))
    return levenshtein(a, b) / longer if longer else 0.0
