"""The machinery that runs a job's shards, in the order a job travels: `plan` (cut the input by cost,
`shard_cut`), `scheduler` (fair share between tenants: `fair_share`, `decayed_usage`, `costs`, each
queue's window: `capacity`), `dispatch` (what a shard's message holds), `endings_inbox` and `settle`
(a shard's ending), `merge` (stitch the outputs, end the job) and `reconcile` (the sweep that makes
every job reach an ending). What a tenant does to a job lives in `portal.jobs`.
"""
