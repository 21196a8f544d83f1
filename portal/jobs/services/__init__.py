"""What a tenant does to a job: submit (and dry run), cancel, pause, retry, rerun, partial results;
`transitions` holds the one conditional update that moves a job between statuses. The machinery that
runs a job's shards is `portal.execution`.
"""
