"""The Celery app of a GPU host's slot workers (`--app tasks.slot.app`, the launcher's default).

It is `tasks.app`'s one app (same name, settings, routes and task names) narrowed to the slot's task
modules; only a slot's worker process imports this module. What a slot sends to the control side
goes by name: each chord's `shard_done` callback travels in the shard's message, and the result
backend sends it from the slot when the shard ends (`on_chord_part_return`), which needs the
callback's signature, not its code.
"""

from __future__ import annotations

from tasks.app import SLOT_TASK_MODULES, app

app.conf.include = list(SLOT_TASK_MODULES)

__all__ = ["app"]
