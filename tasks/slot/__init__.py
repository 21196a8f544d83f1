"""A slot's runtime: the tasks of GPU (and `cpu`) queues, which touch no database, and what connects to
a slot process's start (heartbeat, preloading, busy clock). It imports no control task and no Django."""
