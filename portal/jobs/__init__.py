"""Jobs and their shards, and the services that move a job from submission to its ending."""
