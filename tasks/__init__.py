"""Celery side of Batchery: the app and its config, the control tasks (plan, merge), the shard task,
storage backends and record formats."""
