"""The device operations CUDA IPC between two processes needs, behind one small interface.

The CUDA IPC transport (``replay_server.service.cuda_ipc_sink`` and
``replay_client.cuda_ipc_source``) moves a device table's batches to a
learner process on the same host through a ring of device buffers: the
server allocates the slots and interprocess events, exports their handles,
gathers each batch straight into a slot and records the slot's *written*
event; the learner opens the handles, makes its stream wait on *written*,
and records the slot's *released* event when it gives the batch back, which
the server's stream waits on before writing the slot again. No host waits on
either side.

Those operations are :class:`DeviceIpc`; :class:`CudaIpc` implements them
with CUDA and torch's IPC calls. Tests on machines without a GPU install a
simulated backend with :func:`use_backend` (``tests/integration/simulated_ipc.py``),
so the protocol runs end to end between a real server process and a learner.

Handles are JSON-able dicts (bytes as base64): they travel in the transport's
offer. Thread-safety: the backend is stateless apart from what torch keeps;
:func:`use_backend` is meant for start-up (tests), not for a running stream.
"""

from __future__ import annotations

import base64
from typing import Any, Protocol

import torch


class IpcError(RuntimeError):
    """A device handle could not be made or opened (no IPC support: a sandbox, another GPU)."""


class DeviceIpc(Protocol):
    """What CUDA IPC needs from the device: buffers, events, their handles (see the module)."""

    device_type: str
    """The device type batches arrive on (``"cuda"``; ``"cpu"`` for the simulation)."""

    def available(self) -> bool:
        """Whether this process can take part at all (a device is present)."""

    def device_uuid(self, device: torch.device) -> str:
        """A stable name of ``device`` shared by every process of the host (its UUID)."""

    def visible_uuids(self) -> list[str]:
        """The UUIDs of the devices this process sees."""

    def local_device(self, uuid: str) -> torch.device:
        """This process's device of ``uuid`` (raises :class:`IpcError` if not seen)."""

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A new uint8 buffer of ``nbytes`` on ``device`` that can be exported."""

    def export_buffer(self, buffer: torch.Tensor) -> dict[str, Any]:
        """The handle of ``buffer`` another process opens with :meth:`open_buffer`."""

    def open_buffer(self, handle: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The buffer behind ``handle`` as a uint8 tensor (raises :class:`IpcError`)."""

    def event(self, device: torch.device) -> Any:
        """A new interprocess event on ``device``."""

    def export_event(self, event: Any) -> dict[str, Any]:
        """The handle of ``event``."""

    def open_event(self, handle: dict[str, Any], device: torch.device) -> Any:
        """The event behind ``handle`` (raises :class:`IpcError`)."""

    def record(self, event: Any, device: torch.device) -> None:
        """Record ``event`` after the work issued so far on this thread's current stream."""

    def wait(self, event: Any, device: torch.device) -> None:
        """Make this thread's current stream wait for ``event``'s last record (no host wait)."""

    def close(self, objects: list[Any]) -> None:
        """Let go of buffers and events made or opened (the stream ended)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


class CudaIpc:
    """:class:`DeviceIpc` over CUDA: caching-allocator buffers exported with
    ``UntypedStorage._share_cuda_`` and ``torch.cuda.Event(interprocess=True)``.

    Cost: exporting a buffer or an event is a driver call (microseconds); opening
    one maps it into this process (once per stream and slot).
    """

    device_type = "cuda"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_uuid(self, device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    def visible_uuids(self) -> list[str]:
        return [str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())]

    def local_device(self, uuid: str) -> torch.device:
        for i, seen in enumerate(self.visible_uuids()):
            if seen == uuid:
                return torch.device("cuda", i)
        raise IpcError(f"this process does not see the GPU {uuid}")

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def export_buffer(self, buffer: torch.Tensor) -> dict[str, Any]:
        try:
            (device, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = buffer.untyped_storage()._share_cuda_()
        except Exception as exc:
            raise IpcError(f"could not export a CUDA buffer: {exc}") from exc
        return {"device": int(device), "handle": _b64(handle), "size": int(size),
                "offset": int(offset), "ref_handle": _b64(ref_handle),
                "ref_offset": int(ref_offset), "event_handle": _b64(event_handle or b""),
                "event_sync": bool(event_sync), "nbytes": buffer.numel()}

    def open_buffer(self, handle: dict[str, Any], device: torch.device) -> torch.Tensor:
        from torch.multiprocessing import reductions  # torch's own cache of opened handles

        index = device.index if device.index is not None else torch.cuda.current_device()
        memory, offset = _bytes(handle["handle"]), handle["offset"]
        ref_handle, ref_offset = _bytes(handle["ref_handle"]), handle["ref_offset"]
        try:
            with torch.cuda.device(index):
                storage = reductions.storage_from_cache(torch.UntypedStorage, (memory, offset))
                if storage is None:  # as torch.multiprocessing rebuilds a CUDA tensor
                    torch.cuda._lazy_init()
                    storage = torch.UntypedStorage._new_shared_cuda(
                        index, memory, handle["size"], offset, ref_handle, ref_offset,
                        _bytes(handle["event_handle"]), handle["event_sync"])
                    reductions.shared_cache[(memory, offset)] = reductions.StorageWeakRef(
                        storage)
                else:  # already opened here: the producer's new counter is released
                    torch.UntypedStorage._release_ipc_counter(ref_handle, ref_offset,
                                                              device=index)
        except Exception as exc:
            raise IpcError(f"could not open a CUDA IPC memory handle: {exc}") from exc
        tensor = torch.empty(0, dtype=torch.uint8, device=device)
        tensor.set_(storage, 0, (handle["nbytes"],), (1,))
        return tensor

    def event(self, device: torch.device) -> Any:
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))  # creates it on the device
        return event

    def export_event(self, event: Any) -> dict[str, Any]:
        try:
            return {"handle": _b64(bytes(event.ipc_handle()))}
        except Exception as exc:
            raise IpcError(f"could not export a CUDA event: {exc}") from exc

    def open_event(self, handle: dict[str, Any], device: torch.device) -> Any:
        try:
            return torch.cuda.Event.from_ipc_handle(device, _bytes(handle["handle"]))
        except Exception as exc:
            raise IpcError(f"could not open a CUDA IPC event handle: {exc}") from exc

    def record(self, event: Any, device: torch.device) -> None:
        event.record(torch.cuda.current_stream(device))

    def wait(self, event: Any, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    def close(self, objects: list[Any]) -> None:
        objects.clear()  # torch frees them with their last reference


_BACKEND: DeviceIpc = CudaIpc()


def backend() -> DeviceIpc:
    """The device IPC backend of this process (CUDA unless a test installed another)."""
    return _BACKEND


def use_backend(ipc: DeviceIpc) -> DeviceIpc:
    """Install ``ipc`` as this process's backend (tests); returns the previous one."""
    global _BACKEND
    previous, _BACKEND = _BACKEND, ipc
    return previous
