"""The audit log: who changed what, read-only for operators."""
