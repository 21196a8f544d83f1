"""What a Parquet input may expand to as it is read: its own compression and dictionary encoding let a
small file stand for far more bytes than it holds, past what `DecompressionLimits` sees of the file.

Before a row is read, the row groups' uncompressed sizes (from the footer) of the columns read must fit
the limits' `max_bytes`; dictionaries are kept encoded as batches are read, each row's decoded size
(`row_bytes`) is held to BATCHERY_MAX_PARQUET_ROW_BYTES, and the rows' decoded bytes together to the same
limits as a compressed input (`ExpansionMeter`): its bytes and, past its first `ratio_after` bytes, its
ratio to the file's size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.shared.config import MAX_COMPRESSION_RATIO, MAX_PARQUET_ROW_BYTES
from tasks.shared.formats.compression import DecompressionLimitExceeded, DecompressionLimits


def is_string(data_type: Any) -> bool:
    """A string column, dictionary-encoded or not."""
    if pa.types.is_dictionary(data_type):
        data_type = data_type.value_type
    return bool(
        pa.types.is_string(data_type) or pa.types.is_large_string(data_type) or pa.types.is_string_view(data_type)
    )


def is_messages(data_type: Any) -> bool:
    """A list of structs: a chat's messages."""
    is_list = pa.types.is_list(data_type) or pa.types.is_large_list(data_type)
    return bool(is_list and pa.types.is_struct(data_type.value_type))


def check_declared_sizes(parquet: pq.ParquetFile, columns: list[str], *, limits: DecompressionLimits) -> None:
    """Raise `DecompressionLimitExceeded` where the columns read, uncompressed as the footer declares them,
    pass `limits.max_bytes`, naming the row group and the column that pass it."""
    metadata = parquet.metadata
    total = 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            chunk = row_group.column(index)
            column = chunk.path_in_schema.split(".")[0]
            if column not in columns:
                continue
            total += chunk.total_uncompressed_size
            if total > limits.max_bytes:
                raise DecompressionLimitExceeded(
                    f"the Parquet input's pages uncompress to more than {limits.max_bytes} bytes "
                    f"(row group {group + 1}, column {column!r}), the limit {limits.bytes_setting} sets",
                    limit=limits.max_bytes,
                    setting=limits.bytes_setting,
                )


def encoded_columns(parquet: pq.ParquetFile, columns: list[str]) -> list[str]:
    """The paths of the byte-array leaves of `columns` (nested ones included), to be read as dictionaries."""
    schema = parquet.schema
    return [
        schema.column(index).path
        for index in range(len(schema))
        if schema.column(index).physical_type == "BYTE_ARRAY" and schema.column(index).path.split(".")[0] in columns
    ]


def row_bytes(array: pa.Array) -> np.ndarray:
    """Each row's decoded size in bytes: a string's (a dictionary's value as often as it is used), a list of
    messages' string fields together, an integer's 8; read from the arrays' lengths, nothing decoded."""
    rows = len(array)
    if isinstance(array, pa.DictionaryArray):
        sizes = row_bytes(array.dictionary)
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
        return np.asarray(sizes[indices] if len(sizes) else np.zeros(rows, dtype=np.int64), dtype=np.int64)
    data_type = array.type
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type) or pa.types.is_binary(data_type):
        return np.asarray(pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        values = array.flatten()
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=row_bytes(values), minlength=rows).astype(np.int64)
    if pa.types.is_struct(data_type):
        sizes = np.zeros(rows, dtype=np.int64)
        for index in range(data_type.num_fields):
            sizes += row_bytes(array.field(index))
        return sizes
    return np.full(rows, 8, dtype=np.int64)


class ExpansionMeter:
    """Counts the rows' decoded bytes against `limits`, for a file of `file_bytes`."""

    def __init__(self, *, limits: DecompressionLimits, file_bytes: int) -> None:
        self.limits = limits
        self.file_bytes = max(file_bytes, 1)
        self.row_limit = MAX_PARQUET_ROW_BYTES.read()
        self.decoded = 0

    def oversized(self, sizes: np.ndarray) -> list[int]:
        """Offsets of the rows over BATCHERY_MAX_PARQUET_ROW_BYTES."""
        return [int(offset) for offset in np.flatnonzero(sizes > self.row_limit)]

    def row_problem(self, size: int, column: str) -> str:
        return (
            f"the row holds {size} bytes in column {column!r}, more than the {self.row_limit} a row may hold "
            f"({MAX_PARQUET_ROW_BYTES.name})"
        )

    def add(self, sizes: np.ndarray, *, first_row: int) -> None:
        """Count a batch's rows (the first numbered `first_row`); raise `DecompressionLimitExceeded` past the
        limits, naming the batch's rows."""
        self.decoded += int(sizes.sum())
        limits, rows = self.limits, f"rows {first_row}-{first_row + len(sizes) - 1}"
        if self.decoded >= limits.ratio_after and self.decoded > limits.max_ratio * self.file_bytes:
            raise DecompressionLimitExceeded(
                f"the Parquet input expands more than {limits.max_ratio:g} times as it is decoded "
                f"({self.decoded} bytes from {self.file_bytes} by {rows}), the limit {MAX_COMPRESSION_RATIO.name} sets",
                limit=limits.max_ratio,
                setting=MAX_COMPRESSION_RATIO.name,
            )
        if self.decoded > limits.max_bytes:
            raise DecompressionLimitExceeded(
                f"the Parquet input decodes to more than {limits.max_bytes} bytes (by {rows}), the limit "
                f"{limits.bytes_setting} sets",
                limit=limits.max_bytes,
                setting=limits.bytes_setting,
            )


def batch_values(array: pa.Array, oversized: set[int]) -> list[Any]:
    """The batch's values, but None for the `oversized` rows, which are never decoded."""
    if not oversized:
        return list(array.to_pylist())
    return [None if offset in oversized else array[offset].as_py() for offset in range(len(array))]
