"""A simulated CUDA IPC backend (:class:`~replay_feed.device_ipc.DeviceIpc`) for machines without a GPU.

Device buffers are /dev/shm files mapped by both processes (torch.from_file,
shared), so a server process and a learner really share the slots the way
CUDA IPC would share device memory. An interprocess event is an int64
counter in its own /dev/shm file: ``record`` adds one, and ``wait`` checks
the ordering the real GPU would enforce: the k-th wait on an event (in this
process) needs at least k records of it (by either process), else it raises
:class:`OrderingError`. So a server that writes a slot again before the learner
released it, or a learner reading a slot before the server wrote it, fails
the stream instead of passing silently.

``refuse``: opening any handle raises :class:`~replay_feed.device_ipc.IpcError`
(a sandbox without IPC); ``refuse_export``: so does exporting one (the server's side). ``devices``: the GPU UUIDs this process "sees".
"""

from __future__ import annotations

import os
import uuid as uuids
from pathlib import Path
from typing import Any

import torch

from replay_feed.device_ipc import IpcError

SHM = Path("/dev/shm")
PREFIX = "replay-simipc-"
GPU = "SIM-GPU-0"


class OrderingError(RuntimeError):
    """A wait on a simulated event that the other side had not recorded often enough."""


class SimEvent:
    """An int64 counter in a /dev/shm file, and how often this process waited on it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = torch.from_file(str(path), shared=True, size=1, dtype=torch.int64)
        self.waits = 0


class SimulatedIpc:
    """See the module docstring."""

    device_type = "cpu"

    def __init__(self, devices: tuple[str, ...] = (GPU,), refuse: bool = False,
                 refuse_export: bool = False) -> None:
        self.devices = list(devices)
        self.refuse = refuse
        self.refuse_export = refuse_export
        self.made: list[Path] = []  # files this process created (unlinked on close)
        self.opened = 0  # handles opened

    def available(self) -> bool:
        return True

    def device_uuid(self, device: torch.device) -> str:
        return GPU

    def visible_uuids(self) -> list[str]:
        return list(self.devices)

    def local_device(self, uuid: str) -> torch.device:
        if uuid not in self.devices:
            raise IpcError(f"this process does not see the GPU {uuid}")
        return torch.device("cpu")

    def _file(self, nbytes: int) -> Path:
        path = SHM / f"{PREFIX}{os.getpid()}-{uuids.uuid4().hex}"
        with open(path, "wb") as f:
            f.truncate(nbytes)
        self.made.append(path)
        return path

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        path = self._file(nbytes)
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        buffer._sim_path = str(path)  # type: ignore[attr-defined]
        return buffer

    def export_buffer(self, buffer: torch.Tensor) -> dict[str, Any]:
        if self.refuse_export:
            raise IpcError("simulated: cudaIpcGetMemHandle refused (no IPC here)")
        return {"path": buffer._sim_path, "nbytes": buffer.numel()}  # type: ignore[attr-defined]

    def open_buffer(self, handle: dict[str, Any], device: torch.device) -> torch.Tensor:
        if self.refuse:
            raise IpcError("simulated: cudaIpcOpenMemHandle refused (no IPC here)")
        self.opened += 1
        return torch.from_file(handle["path"], shared=True, size=handle["nbytes"],
                               dtype=torch.uint8)

    def event(self, device: torch.device) -> SimEvent:
        return SimEvent(self._file(8))

    def export_event(self, event: SimEvent) -> dict[str, Any]:
        return {"path": str(event.path)}

    def open_event(self, handle: dict[str, Any], device: torch.device) -> SimEvent:
        if self.refuse:
            raise IpcError("simulated: cudaIpcOpenEventHandle refused (no IPC here)")
        self.opened += 1
        return SimEvent(Path(handle["path"]))

    def record(self, event: SimEvent, device: torch.device) -> None:
        event.count += 1

    def wait(self, event: SimEvent, device: torch.device) -> None:
        event.waits += 1
        recorded = int(event.count.item())
        if recorded < event.waits:
            raise OrderingError(f"simulated IPC: wait {event.waits} on {event.path.name}, "
                                f"which was recorded only {recorded} times")

    def close(self, objects: list[Any]) -> None:
        paths = {str(o.path) for o in objects if isinstance(o, SimEvent)}
        paths |= {getattr(o, "_sim_path", "") for o in objects}
        for path in list(self.made):
            if str(path) in paths:
                path.unlink(missing_ok=True)
                self.made.remove(path)
        objects.clear()
