"""Operating Batchery: the `up`, `submit`, `tenant` and `demo` commands and the embedded services."""
