"""Every write to jobs and shards, in the order a job travels: submit, plan, dispatch, merge.

`transitions` holds the one conditional update that moves a job between statuses.
"""
