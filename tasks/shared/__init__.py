"""The layer both sides of a shard's message share: configuration, storage, record formats and the
shard protocol. It imports neither Django nor `portal` (an import-linter contract holds it)."""
