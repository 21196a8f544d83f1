"""Batchery's Celery side, in three rooms around one app (`tasks.app`):

- `tasks.shared`: what both sides of a shard's message share: configuration, storage, record formats
  and the shard protocol (specs, commit markers, leases, stops, progress, fleet keys). No Django, no
  `portal`.
- `tasks.control`: the control queue's tasks, thin adapters over `portal` services.
- `tasks.slot`: a GPU (or `cpu`) slot's runtime: its Celery app and worker entry, running a shard,
  bisecting poison records, heartbeats and preloading. No control task, no Django.

Work is sent by task name (`tasks.send`), so no process imports another side's task code to send it.
"""
