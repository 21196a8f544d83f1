"""The demo: a few thousand sentences through the real stack with the bundled model."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

SUBJECTS = ["The engineer", "A small robot", "The night train", "Our GPU fleet", "A curious cat", "The old library"]
VERBS = ["quietly watches", "carefully builds", "slowly crosses", "happily shares", "loudly questions", "finds"]
OBJECTS = ["the river", "a new dataset", "every shard", "the mountain road", "a warm cup of tea", "the last page"]
ENDINGS = ["at dawn.", "before the rain.", "without a sound.", "in record time.", "once more.", "for the team."]


def write_demo_dataset(path: Path, *, sentences: int, seed: int = 7) -> Path:
    """Write `sentences` records of the form {"custom_id", "input"} to a JSONL file."""
    rng = random.Random(seed)
    combos = list(itertools.product(SUBJECTS, VERBS, OBJECTS, ENDINGS))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for n in range(sentences):
            subject, verb, obj, ending = combos[rng.randrange(len(combos))]
            # A varying tail keeps lengths (and so padding) as uneven as real text.
            tail = " ".join(rng.choice(OBJECTS).split()[-1] for _ in range(rng.randrange(0, 12)))
            text = f"{subject} {verb} {obj} {ending} {tail}".strip()
            handle.write(json.dumps({"custom_id": f"sentence-{n:06d}", "input": text}))
            handle.write("\n")
    return path
