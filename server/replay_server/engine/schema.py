"""A table's schema: for each flat key, the dtype and per-row shape of its column.

The schema is fixed by the table's config or by its first insert; every later
insert must match it exactly (no implicit casts), or it is refused as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replay_proto.dtype_names import ITEMSIZES, check_dtype_name
from replay_proto.keys import check_prefixes
from replay_proto.scalars import is_int
from replay_server.errors import InvalidArgumentError, SchemaMismatchError

if TYPE_CHECKING:
    import torch

MAX_ROW_BYTES = 2**31 - 1
"""Largest row of one column, in bytes (a row must fit a gRPC message, which is below 2 GiB)."""

MAX_ROW_DIMS = 32
"""Most dimensions of one row (a batch adds up to two: batch and slice, within the wire's 64)."""


@dataclass(frozen=True, slots=True, init=False)
class FieldSpec:
    """dtype and per-row shape of one column (the shape excludes the row dim).

    Holds the dtype's stable name (:mod:`replay_proto.dtype_names`), given as a
    name or a ``torch.dtype``; :attr:`dtype` is the ``torch.dtype``. A config's
    schema is read, checked and sized with no torch loaded (``check-config``).

    Every dimension is at least 1 (a column of zero-size rows stores nothing
    and would fix a table's schema to nonsense) and one row is at most
    :data:`MAX_ROW_BYTES`, of at most :data:`MAX_ROW_DIMS` dimensions.

    Raises:
        ValueError: an unsupported dtype, a dimension below 1, or a row too large.
    """

    dtype_name: str
    shape: tuple[int, ...]

    def __init__(self, dtype: str | torch.dtype, shape: Iterable[int] = ()) -> None:
        if not isinstance(dtype, str):  # a torch.dtype: given only where torch is loaded
            from replay_proto.dtypes import dtype_name

            dtype = dtype_name(dtype)
        object.__setattr__(self, "dtype_name", check_dtype_name(dtype))
        shape = tuple(shape)
        if any(not is_int(d) or d < 1 for d in shape):
            raise ValueError(f"every dimension of a row must be an integer >= 1, got shape "
                             f"{list(shape)}")
        object.__setattr__(self, "shape", shape)
        if len(self.shape) > MAX_ROW_DIMS:
            raise ValueError(f"a row has {len(self.shape)} dimensions, at most {MAX_ROW_DIMS} "
                             f"are allowed")
        if self.row_bytes > MAX_ROW_BYTES:
            raise ValueError(f"a row of shape {list(self.shape)} would take "
                             f"{self.row_bytes:,} bytes, over the limit of {MAX_ROW_BYTES:,}")

    @property
    def dtype(self) -> torch.dtype:
        """The column's ``torch.dtype`` (asking for it loads torch)."""
        from replay_proto.dtypes import DTYPES

        return DTYPES[self.dtype_name]

    @property
    def row_bytes(self) -> int:
        """Bytes one row of this column occupies."""
        n = 1
        for d in self.shape:
            n *= d
        return n * ITEMSIZES[self.dtype_name]

    def describe(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}"

    @classmethod
    def of_column(cls, column: torch.Tensor) -> FieldSpec:
        """The spec of a column tensor whose dim 0 is rows."""
        return cls(column.dtype, tuple(column.shape[1:]))


class Schema(Mapping[str, FieldSpec]):
    """An ordered, immutable mapping of flat key -> :class:`FieldSpec`."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Mapping[str, FieldSpec]) -> None:
        self._fields = dict(fields)

    def __getitem__(self, key: str) -> FieldSpec:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Schema({self.describe()})"

    @property
    def row_bytes(self) -> int:
        """Bytes one row occupies across all columns."""
        return sum(spec.row_bytes for spec in self._fields.values())

    def describe(self) -> dict[str, str]:
        """``{key: "float32[17]"}``, for messages and ``info``."""
        return {key: spec.describe() for key, spec in self._fields.items()}

    def check(self, columns: Mapping[str, torch.Tensor], table: str) -> None:
        """Raise unless ``columns`` has exactly this schema's keys, dtypes and shapes.

        Raises:
            SchemaMismatchError: naming the key, the expected and the received
                dtype/shape (or the missing / unexpected keys).
        """
        missing = [k for k in self._fields if k not in columns]
        extra = [k for k in columns if k not in self._fields]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if extra:
                parts.append(f"unexpected keys {extra}")
            raise SchemaMismatchError(
                f"table {table!r}: insert does not match the schema: {'; '.join(parts)} "
                f"(schema: {self.describe()})"
            )
        for key, spec in self._fields.items():
            column = columns[key]
            if column.dtype != spec.dtype or tuple(column.shape[1:]) != spec.shape:
                raise SchemaMismatchError(
                    f"table {table!r}: key {key!r} expects dtype/shape {spec.describe()} "
                    f"per row, got {str(column.dtype).removeprefix('torch.')}"
                    f"{list(column.shape[1:])}"
                )

    def batch_layout(self, lead: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Flat key -> (dtype, shape) of each column of a batch with leading dims ``lead``."""
        return {key: (spec.dtype, (*lead, *spec.shape)) for key, spec in self._fields.items()}

    def out_problem(self, lead: tuple[int, ...], out: Mapping[str, torch.Tensor]) -> str | None:
        """Why ``out`` cannot receive a batch with leading dims ``lead`` (None: it can).

        Keys missing from ``out`` are fine (they get new tensors).
        """
        for key, (dtype, shape) in self.batch_layout(lead).items():
            dest = out.get(key)
            if dest is not None and (
                dest.dtype != dtype or tuple(dest.shape) != shape or not dest.is_contiguous()
            ):
                return (f"out[{key!r}] must be a contiguous {dtype} tensor of shape "
                        f"{list(shape)}, got {dest.dtype} {list(dest.shape)}")
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (loadable without code execution)."""
        return {
            key: {"dtype": spec.dtype_name, "shape": list(spec.shape)}
            for key, spec in self._fields.items()
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Schema:
        """The schema :meth:`state_dict` saved.

        Raises:
            ValueError: a dtype, shape or key is invalid (keys colliding as paths included).
        """
        check_prefixes(state)
        return cls(
            {
                key: FieldSpec(check_dtype_name(value["dtype"]), tuple(value["shape"]))
                for key, value in state.items()
            }
        )


def schema_of(columns: Mapping[str, torch.Tensor], table: str) -> Schema:
    """The schema a first insert of ``columns`` fixes.

    Raises:
        InvalidArgumentError: a column's rows have a zero-size or absurd shape
            (the message names the key).
    """
    fields = {}
    for key, column in columns.items():
        try:
            fields[key] = FieldSpec.of_column(column)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"table {table!r}: key {key!r} cannot fix the table's schema: {exc}") from None
    return Schema(fields)

