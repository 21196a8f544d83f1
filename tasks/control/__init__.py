"""The control queue's tasks: thin adapters that call `portal` services, on `base.ControlTask`.

Each body imports its service when it runs: Django is set up by the task's first call
(`base.ensure_django`), not when Celery imports the module.
"""
