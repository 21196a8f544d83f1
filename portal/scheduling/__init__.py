"""How the GPU fleet is shared: fair share between tenants, the decayed usage ledger, each class's window.

The decisions are made by `portal.jobs.services.scheduler`, which uses these parts.
"""
