"""GPU-side code of Batchery: engines, the warm model cache and the worker launcher.

Nothing here imports Django or `tasks`; GPU hosts need only the broker and the storage.
"""
