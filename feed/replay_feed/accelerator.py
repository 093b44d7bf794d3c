"""The accelerator operations a learner's batch feed needs, in one small interface.

A feed pins host buffers, copies them to the device asynchronously on a side
stream, and hands the consumer's stream an event to wait on. Those five
operations are all it needs from the accelerator, so they sit behind
:class:`Accelerator`; :class:`CudaAccelerator` implements them with CUDA, and
tests on machines without a GPU substitute a simulated one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Accelerator(Protocol):
    """Pinning, asynchronous copies and events for one kind of device."""

    device_type: str

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new page-locked host tensor."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is page-locked (device copies from it are asynchronous)."""

    def register(self, tensor: torch.Tensor) -> bool:
        """Page-lock existing host memory in place (e.g. a shared-memory ring); False if refused."""

    def unregister(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register`."""

    def copy(self, tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], Any]:
        """Start copying ``tensors`` to ``device`` off the consumer's stream; return them and an event."""

    def consume(self, tensors: Sequence[torch.Tensor], event: Any) -> None:
        """Make the current stream wait for ``event`` and own ``tensors`` from now on (no host wait)."""

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until the copy behind ``event`` has finished."""

    def record(self, device: torch.device) -> Any:
        """An event after the work issued so far on ``device``'s current stream (for a batch
        made on the device itself: the learner's stream waits for it in :meth:`consume`)."""


class CudaAccelerator:
    """:class:`Accelerator` over CUDA: one side stream per device for host-to-device copies.

    Thread-safety: :meth:`copy` runs on the feed's background thread,
    :meth:`consume` on the learner's; the side streams are created under a lock.
    """

    device_type = "cuda"

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def register(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        return int(status) == 0

    def unregister(self, tensor: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def copy(self, tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], Any]:
        stream = self._side_stream(device)
        with torch.cuda.stream(stream):
            out = [t.to(device, non_blocking=True) for t in tensors]
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def consume(self, tensors: Sequence[torch.Tensor], event: Any) -> None:
        current = torch.cuda.current_stream()
        current.wait_event(event)
        for tensor in tensors:
            if tensor.device.type == "cuda":
                tensor.record_stream(current)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def record(self, device: torch.device) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event


def cuda_present() -> bool:
    """Whether this machine has a CUDA device, asked without initialising CUDA.

    ``torch.cuda.device_count()`` asks NVML (the driver's management library)
    before CUDA is initialised, so answering costs milliseconds and leaves
    CUDA uninitialised; ``torch.cuda.is_available()`` asks the CUDA runtime,
    which initialises the driver (``cuInit``: seconds on some GPU machines).
    A server deciding at start whether its tables may be pinned uses this,
    and pays for CUDA only when a table's storage is really pinned (its first
    insert, a declared schema, or a restore). Where NVML is missing, torch
    falls back to the CUDA runtime (the same answer, at the old cost).
    """
    return torch.cuda.device_count() > 0


def detect_accelerator() -> Accelerator | None:
    """The accelerator of this process (CUDA), or None when there is none."""
    if torch.cuda.is_available():
        return CudaAccelerator()
    return None
