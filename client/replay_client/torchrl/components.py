"""TorchRL's buffer parts (storage, sampler, writer objects) and the server table they need.

A TorchRL buffer is built from parts: ``LazyTensorStorage(N)``,
``PrioritizedSampler(N, alpha, beta)``, ``SliceSampler(num_slices=8)``, a
writer. On a replay server those parts are one table's config. This module
reads the parts a script passes (duck typed, by the TorchRL class names in
their MRO, so torchrl stays optional) into a :class:`TableRequest`: what a
table must be to serve them, as TOML settings (:meth:`TableRequest.config`)
and as checks against a table's ``info`` (:meth:`TableRequest.problems`).

Parts with no server counterpart raise :class:`UnsupportedComponentError`
naming the alternative; nothing is silently ignored.

Thread-safety: pure functions and frozen values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from replay_client.errors import (
    InvalidArgumentError,
    InvalidPriorityError,
    UnsupportedComponentError,
)
from replay_client.table_info import TableInfo
from replay_client.torchrl.episodes import DEFAULT_END_KEYS, EpisodeColumn
from replay_client.torchrl.slices import INIT_KEY, TRUNCATED_KEY, SliceLayout

DEFAULT_CAPACITY = 1000
"""TorchRL's buffer without a storage gets ``ListStorage(max_size=1000)``."""


def _names(obj: Any) -> set[str]:
    """Class names in ``obj``'s MRO that come from torchrl."""
    return {cls.__name__ for cls in type(obj).__mro__
            if getattr(cls, "__module__", "").startswith("torchrl.")}


def flat_key(key: Any) -> str:
    """A TensorDict key (``"a"`` or ``("next", "done")``) as a flat column name."""
    return ".".join(key) if isinstance(key, tuple) else str(key)


@dataclass(frozen=True, slots=True)
class SliceRequest:
    """What a TorchRL ``SliceSampler`` asks of a slice table.

    Attributes:
        slice_len: steps per slice, when fixed (``slice_len=``, or
            ``batch_size // num_slices``); ``None``: decided per sample.
        num_slices: slices per batch (``num_slices=``), else ``None``.
        traj_key: flat column of trajectory ids (TorchRL's ``traj_key``), if given.
        end_keys: flat columns of end-of-trajectory flags (TorchRL's ``end_key``/``end_keys``).
        truncated_key: where samples mark slice ends, as TorchRL's key (``None``: not marked).
        init_key: the stored key OR-ed with slice starts, as TorchRL's (``None``: the stored
            flags are left as they are).
        find_traj_key: the sampler was given neither ``traj_key`` nor ``end_key``: as
            TorchRL's, it takes ``("collector", "traj_ids")`` when the data has it.
        strict_length: TorchRL's ``strict_length`` (``False``: short trajectories are
            sampled too; the table's ``strict_length = false``).
        pad_output: TorchRL's ``pad_output`` (a client-side choice: keep slices padded).
        span_left, span_right: TorchRL's ``span=(left, right)``: ``True``, ``False`` or
            a number of steps (the table's ``span_left``/``span_right``; ``True`` is
            ``slice_len - 1``).
    """

    slice_len: int | None
    num_slices: int | None
    traj_key: str | None
    end_keys: tuple[str, ...]
    truncated_key: Any
    find_traj_key: bool = False
    init_key: Any = INIT_KEY
    strict_length: bool = True
    pad_output: bool = False
    span_left: bool | int = 0
    span_right: bool | int = 0

    def span_steps(self, slice_len: int) -> tuple[int, int]:
        """``(span_left, span_right)`` in steps for slices of ``slice_len`` (``True``:
        ``slice_len - 1``)."""
        return tuple(slice_len - 1 if side is True else int(side)  # type: ignore[return-value]
                     for side in (self.span_left, self.span_right))


@dataclass(frozen=True, slots=True)
class TableRequest:
    """The table a TorchRL buffer's parts need.

    Attributes:
        capacity: rows (``None``: any capacity).
        prioritized: rows must carry priorities.
        alpha: priority exponent asked for (``None``: the table's).
        beta: importance-weight exponent asked for (``None``: the table's).
        slices: set when samples are slices (a ``SliceSampler``).
    """

    capacity: int | None = None
    prioritized: bool = False
    alpha: float | None = None
    beta: float | None = None
    slices: SliceRequest | None = None

    def config(self) -> dict[str, Any]:
        """TOML settings of a ``[[tables]]`` entry that serves this request (name left out)."""
        out: dict[str, Any] = {"capacity": self.capacity or DEFAULT_CAPACITY}
        if self.slices is None:
            out["sampler"] = "prioritized" if self.prioritized else "uniform"
        else:
            out["sampler"] = "prioritized_slice" if self.prioritized else "slice"
            out["slice_len"] = self.slices.slice_len or 1
            out["done_key"] = self.slices.end_keys[0]
            if not self.slices.strict_length:
                out["strict_length"] = False
            for name, steps in zip(("span_left", "span_right"),
                                   self.slices.span_steps(out["slice_len"])):
                if steps:
                    out[name] = steps
        if self.prioritized:
            for name in ("alpha", "beta"):
                value = getattr(self, name)
                if value is not None:
                    out[name] = float(value)
        return out

    def read_shape(self, info: TableInfo) -> tuple[SliceLayout | None, EpisodeColumn | None]:
        """How a buffer reads the table's samples: its slice layout (a slice table) and its
        episode column (a table that keeps episodes), from its ``info`` and the slice
        sampler asked for (TorchRL's defaults where none was)."""
        caps, slices = info.capabilities, self.slices
        layout = None if not caps.slices else SliceLayout(
            info.slice_len or 1, slices.num_slices if slices else None,
            slices.truncated_key if slices else TRUNCATED_KEY,
            slices.init_key if slices else INIT_KEY,
            partial=bool(caps.partial_slices or caps.span_left or caps.span_right),
            pad_output=slices.pad_output if slices else False)
        episodes = None if not caps.episodes else EpisodeColumn(
            info.episode_key, slices.traj_key if slices else None,
            slices.end_keys if slices else DEFAULT_END_KEYS,
            find_traj_key=slices.find_traj_key if slices else True)
        return layout, episodes

    def problems(self, info: TableInfo) -> list[str]:
        """What table ``info`` lacks for this request, each naming the config line to change."""
        found = []
        caps = info.capabilities
        where = f"table {info.name!r}"
        if self.capacity is not None and info.capacity != self.capacity:
            found.append(f"{where} has capacity = {info.capacity}, the storage asks for "
                         f"{self.capacity} (set capacity = {self.capacity}, or pass the "
                         f"table's capacity to the storage)")
        if self.prioritized and not caps.priorities:
            found.append(f"{where} has no priorities (sampler {info.sampler!r}); a "
                         f"prioritized sampler needs sampler = \"prioritized\"")
        if self.slices is None and caps.slices:
            found.append(f"{where} samples slices; a row sampler needs sampler = \"uniform\" "
                         f"or \"prioritized\" (or pass a SliceSampler)")
        if caps.consumes:
            found.append(f"{where} hands each row out once (sampler {info.sampler!r}); "
                         f"TorchRL's samplers draw with replacement")
        if self.slices is not None:
            if not caps.slices:
                found.append(f"{where} samples rows; a SliceSampler needs sampler = \"slice\" "
                             f"(or \"prioritized_slice\") and slice_len")
            elif self.slices.slice_len is not None and info.slice_len != self.slices.slice_len:
                found.append(f"{where} has slice_len = {info.slice_len}, the sampler asks for "
                             f"{self.slices.slice_len} (set slice_len = {self.slices.slice_len})")
            else:
                found.extend(self._slice_shape_problems(info, where))
        return found

    def _slice_shape_problems(self, info: TableInfo, where: str) -> list[str]:
        """The sampler's ``strict_length`` and right ``span`` against the table's."""
        assert self.slices is not None
        found = []
        caps = info.capabilities
        strict = not caps.partial_slices
        if strict != self.slices.strict_length:
            found.append(f"{where} has strict_length = {str(strict).lower()}, the sampler asks "
                         f"for strict_length={self.slices.strict_length} (set strict_length = "
                         f"{str(self.slices.strict_length).lower()})")
        spans = self.slices.span_steps(info.slice_len or 1)
        for name, table, asked in zip(("span_left", "span_right"),
                                      (caps.span_left, caps.span_right), spans):
            if table != asked:
                found.append(f"{where} has {name} = {table}, the sampler's span asks for "
                             f"{asked} (set {name} = {asked})")
        return found


def request_of(*, storage: Any = None, sampler: Any = None, writer: Any = None,
               batch_size: int | None = None, alpha: float | None = None,
               beta: float | None = None) -> TableRequest:
    """Read TorchRL buffer parts into the table they need.

    Args:
        storage: a TorchRL storage (its ``max_size`` is the capacity), or ``None``.
        sampler: a TorchRL sampler, or ``None`` (uniform).
        writer: a TorchRL writer, or ``None`` (round robin).
        batch_size: the buffer's batch size (decides ``slice_len`` with ``num_slices``).
        alpha, beta: a prioritized buffer's own arguments (they override the sampler's).

    Raises:
        UnsupportedComponentError: a part has no server counterpart (the message names
            what to use instead).
    """
    storage, sampler, writer = (built(part) for part in (storage, sampler, writer))
    capacity = _capacity(storage, sampler)
    _check_writer(writer)
    prioritized = alpha is not None or beta is not None
    slices = None
    if sampler is not None:
        names = _names(sampler)
        if "SamplerWithoutReplacement" in names:
            raise UnsupportedComponentError(
                f"{type(sampler).__name__} (each element once per epoch) has no server "
                f"counterpart: a table samples with replacement (sampler \"uniform\"), or hands "
                f"each row out once (sampler \"fifo\"); pass no sampler for uniform sampling")
        if "PrioritizedSampler" in names:
            prioritized = True
            alpha = getattr(sampler, "_alpha", None) if alpha is None else alpha
            beta = getattr(sampler, "_beta", None) if beta is None else beta
        if "SliceSampler" in names:
            slices = _slice_request(sampler, batch_size)
        elif not names & {"RandomSampler", "PrioritizedSampler"}:
            raise UnsupportedComponentError(
                f"sampler {type(sampler).__name__} has no server counterpart; use RandomSampler, "
                f"PrioritizedSampler, SliceSampler or PrioritizedSliceSampler (tables with "
                f"sampler \"uniform\", \"prioritized\", \"slice\" or \"prioritized_slice\")")
    return TableRequest(capacity=capacity, prioritized=prioritized, alpha=alpha, beta=beta,
                        slices=slices)


def built(part: Any) -> Any:
    """TorchRL takes parts or factories of parts (``partial(LazyTensorStorage, 100)``)."""
    if part is not None and not _names(part) and callable(part):
        return part()
    return part


def _capacity(storage: Any, sampler: Any) -> int | None:
    if storage is None:
        # TorchRL's default ListStorage(1000) behind a PrioritizedSampler(max_capacity) keeps
        # priorities for max_capacity positions only: that many rows are what it serves.
        return int(getattr(sampler, "_max_capacity", None) or DEFAULT_CAPACITY)
    names = _names(storage)
    if "StorageEnsemble" in names or not hasattr(storage, "max_size"):
        raise UnsupportedComponentError(
            f"storage {type(storage).__name__} has no server counterpart; pass "
            f"LazyTensorStorage(capacity) (a table's rows live on the server)")
    return int(storage.max_size)


def _check_writer(writer: Any) -> None:
    if writer is None:
        return
    names = _names(writer)
    if names & {"RoundRobinWriter", "TensorDictRoundRobinWriter"}:
        return
    raise UnsupportedComponentError(
        f"writer {type(writer).__name__} has no server counterpart: a table overwrites its "
        f"oldest rows when full (TorchRL's RoundRobinWriter); pass no writer")


def _slice_request(sampler: Any, batch_size: int | None) -> SliceRequest:
    names = _names(sampler)
    if "SliceSamplerWithoutReplacement" in names:
        raise UnsupportedComponentError(
            "SliceSamplerWithoutReplacement has no server counterpart: slice tables draw with "
            "replacement; use SliceSampler")
    span = getattr(sampler, "span", (False, False))
    if not isinstance(span, (tuple, list)):
        span = (span, span)
    span_left, span_right = (side if isinstance(side, bool) else int(side) for side in span)
    for name, default, why in (
            ("fragmented", False, "an episode's steps are linked by the table whatever their "
                                  "storage positions; pass no fragmented"),
):
        value = getattr(sampler, name, default)
        if value is not None and (not isinstance(value, bool) or value != default):
            raise UnsupportedComponentError(
                f"{type(sampler).__name__}({name}={value!r}) has no server counterpart: {why}")
    cache = getattr(sampler, "_cache", None) or {}
    if "static-stop-and-length" in cache or (  # TorchRL keeps them there, not as attributes
            "stop-and-length" in cache and getattr(sampler, "end_key", 0) is None
            and getattr(sampler, "traj_key", 0) is None):  # (torchrl 0.13's key)
        raise UnsupportedComponentError(
            f"{type(sampler).__name__}(trajectories=... or ends=...) has no server "
            f"counterpart: the table finds episodes in the rows' episode ids and end flags; "
            f"write them with the data (traj_key=... or end_key=...)")
    num_slices = getattr(sampler, "num_slices", None)
    slice_len = getattr(sampler, "slice_len", None)
    if slice_len is None and num_slices is not None and batch_size is not None:
        if batch_size % num_slices:
            raise InvalidArgumentError(
                f"batch_size={batch_size} is not a multiple of num_slices={num_slices}")
        slice_len = batch_size // num_slices
    end_keys = getattr(sampler, "end_keys", None) or [
        getattr(sampler, "end_key", None) or ("next", "done")]
    traj_key = getattr(sampler, "traj_key", None)
    truncated_key = getattr(sampler, "truncated_key", TRUNCATED_KEY)
    return SliceRequest(
        slice_len=slice_len, num_slices=num_slices,
        traj_key=None if traj_key is None else flat_key(traj_key),
        end_keys=tuple(flat_key(k) for k in end_keys),
        truncated_key=truncated_key,
        init_key=getattr(sampler, "init_key", "is_init"),
        find_traj_key=bool(getattr(sampler, "_traj_key_auto", traj_key is None)),
        strict_length=bool(getattr(sampler, "strict_length", True)),
        pad_output=bool(getattr(sampler, "pad_output", False)),
        span_left=span_left, span_right=span_right)


IGNORED_OPTIONS: dict[str, str] = {
    "shared": "a table is shared already: every process that connects uses it",
    "compilable": "sampling runs on the server, outside torch.compile",
    "delayed_init": "the table exists before the buffer",
    "dtype": "priorities travel as float64 and are summed as float32 on the server",
    "sampler_device": "sampling runs on the server",
    "sync": "every write is acknowledged by the server before extend returns",
}
"""TorchRL buffer options that mean nothing for a table on a server: accepted, with why."""

UNSUPPORTED_OPTIONS: dict[str, tuple[Any, str]] = {
    "sample_unit": (None, "TorchRL's sample units have no server counterpart; a slice table "
                          "samples sequences (sampler = \"slice\")"),
    "checkpointer": (None, "save the buffer with rb.dumps(path) / rb.loads(path), or "
                           "checkpoint the server (client.checkpoint())"),
    "consume_after_n_samples": (None, "configure the table with max_times_sampled = n (rows "
                                      "retire after n draws), or sampler = \"fifo\""),
    "dim_extend": (None, "a TensorDict's batch dimensions decide what a row is ([n_envs, T]: "
                         "n_envs * T rows, each env's steps kept in order)"),
    "service_backend": ("direct", "the buffer is a service already: its table is on a server"),
    "service_backend_options": (None, "the buffer is a service already"),
    "transport": ("auto", "the buffer talks gRPC (or shared memory) to its server"),
    "transport_options": (None, "the buffer talks gRPC (or shared memory) to its server"),
}
"""TorchRL buffer options with no server counterpart: refused unless left at TorchRL's
default (the value), naming the alternative."""

REDUCTIONS = ("max", "min", "mean", "median")
"""How TorchRL reduces a row's priorities over trailing dims (``reduction=``)."""


@dataclass(frozen=True, slots=True)
class PriorityOptions:
    """How written priorities become one per row: ``abs(p) + eps``, ``reduction`` over trailing dims."""

    eps: float = 1e-8
    reduction: str = "max"


def priority_options(sampler: Any, options: dict[str, Any]) -> PriorityOptions:
    """``eps`` and ``reduction`` from the buffer's options, else from a prioritized sampler.

    Raises:
        UnsupportedComponentError: an option of :data:`UNSUPPORTED_OPTIONS` not at its
            default, or an unknown reduction.
        TypeError: an option TorchRL's buffers do not take either.
    """
    for name, value in options.items():
        if name in IGNORED_OPTIONS or name in ("eps", "reduction", "collate_fn"):
            continue
        if name in UNSUPPORTED_OPTIONS:
            default, why = UNSUPPORTED_OPTIONS[name]
            if value is not default and value != default:
                raise UnsupportedComponentError(f"{name}={value!r} has no server counterpart: "
                                                f"{why}")
            continue
        raise TypeError(f"RemoteReplayBuffer() got an unexpected keyword argument {name!r}")
    sampler = built(sampler)
    eps = options.get("eps", getattr(sampler, "_eps", 1e-8))
    reduction = options.get("reduction", getattr(sampler, "reduction", "max"))
    if reduction not in REDUCTIONS:
        raise UnsupportedComponentError(f"reduction must be one of {REDUCTIONS}, got "
                                        f"{reduction!r}")
    return PriorityOptions(float(eps), reduction)


def row_priorities(value: Any, rows: int, options: PriorityOptions) -> torch.Tensor:
    """``[rows]`` float64 priorities: ``abs + eps``, trailing dims reduced (TorchRL's rule)."""
    tensor = torch.as_tensor(value).detach().cpu().to(torch.float64)
    if tensor.numel() == rows:
        flat = tensor.reshape(rows)
    elif tensor.dim() and rows and tensor.numel() % rows == 0:
        per_row = tensor.reshape(rows, -1).abs()
        if options.reduction == "median":
            flat = per_row.median(dim=1).values
        else:
            flat = getattr(per_row, {"max": "amax", "min": "amin", "mean": "mean"}[
                options.reduction])(dim=1)
    else:
        raise InvalidPriorityError(
            f"priorities of shape {list(tensor.shape)} do not fit {rows} rows")
    return flat.abs() + options.eps
