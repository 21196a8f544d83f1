"""The fleet simulator (`manage.py simulate`): the real control plane against many virtual GPU slots.

`gpu_model` stands in for the model (a shard's time from a per-class speed); `fleet` runs the virtual
slots, many a process, speaking the slots' protocol; `workload` makes the tenants and their jobs;
`report` turns what happened into the figures. docs/simulator.md says what it measures and leaves out.
"""
