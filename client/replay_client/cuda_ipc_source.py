"""CUDA IPC's learner side: a device table's batches as views of a same-host ring of GPU buffers.

A learner process that delivers to a GPU asks for ``cuda_ipc`` in its first
message, saying its host (boot id), its process and the UUIDs of the GPUs it
sees. A server on that host whose table lives on one of them offers a ring of
``window + 1`` device buffers with two interprocess events per slot
(``replay_server.service.cuda_ipc_sink``). The learner opens the buffers and
events and accepts; from then on each message names a slot, and the batch is
views of that slot on the learner's GPU (no host copy, no PCIe round trip).

Ordering without host waits: producing a batch makes the producer's current
stream wait on the slot's *written* event (the feed's own event, recorded
after it, is what the learner's stream waits on in ``next()``); when the
learner gives the batch back (asks for the next) its current stream records
the slot's *released* event, before that credit is sent, and the server's
stream waits on it before writing the slot again. A batch is valid until the
learner asks for the next one (clone to keep it), as the shared-memory ring's
host views.

Fallback: a handle that cannot be opened (no IPC in a sandbox, another
container, a driver refusing), a ring whose slots do not match the window, or
a stream delivering to another GPU than the table's, is refused with the
reason (logged once per process, and in ``stream.stats.notes``); the stream
then goes on with host copies over gRPC. The device operations are
:mod:`replay_feed.device_ipc`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from replay_client.batch_source import Opened, SourceContext, transport_answer, transport_offer
from replay_feed import device_ipc
from replay_feed.delivery import Delivery
from replay_feed.shared_ring import host_id
from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.stream")

NAME = "cuda_ipc"

_LOGGED = threading.Event()  # a refusal is logged once per process


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise device_ipc.IpcError(f"unknown dtype {name!r} in the offer")
    return dtype


class CudaIpcSource:
    """An opened device ring (see the module docstring); made by :data:`CUDA_IPC`.

    Args:
        ipc: the device backend.
        device: this process's device of the table's GPU.
        params: the server's offer.
        buffers, written, released: the opened slots and their events.
        given_back: the call's ``given_back(k, fn)``.
    """

    name = NAME
    window_grows = False  # one slot per batch of the window, fixed when the ring was made

    def __init__(self, ipc: device_ipc.DeviceIpc, device: torch.device, params: dict[str, Any],
                 buffers: list[torch.Tensor], written: list[Any], released: list[Any],
                 given_back: Callable[[int, Callable[[], None]], None]) -> None:
        self._ipc = ipc
        self._device = device
        self._keys: list[str] = list(params["keys"])
        self._specs = [(_dtype(d), tuple(s)) for d, s in zip(params["dtypes"], params["shapes"])]
        self._offsets: list[int] = list(params["offsets"])
        self._buffers = buffers
        self._written = written
        self._released = released
        self._given_back = given_back

    def batches(self, header: pb.SampleResponse, payload: memoryview) -> list[SampleBatch] | None:
        if not header.transport_batch:
            return None
        slot = int(header.transport_batch.decode())
        if not 0 <= slot < len(self._buffers):
            raise device_ipc.IpcError(f"the server named slot {slot} of a ring of "
                                      f"{len(self._buffers)}")
        ipc, device = self._ipc, self._device
        ipc.wait(self._written[slot], device)  # the gather into it is done first (on the GPU)
        views = []
        buffer = self._buffers[slot]
        for offset, (dtype, shape) in zip(self._offsets, self._specs):
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            views.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
        n = len(self._keys)
        mass = SamplingMass.from_proto(header.mass) if header.HasField("mass") else None
        released = self._released[slot]  # (the learner may give it back after close())
        self._given_back(header.batch_index, lambda: ipc.record(released, device))
        return [SampleBatch.from_flat(dict(zip(self._keys, views[:n])), views[n:], mass=mass)]

    def close(self) -> None:
        objects: list[Any] = [*self._buffers, *self._written, *self._released]
        self._buffers, self._written, self._released = [], [], []
        if objects:
            self._ipc.close(objects)


class CudaIpcSources:
    """CUDA IPC's entry in the source registry (``cuda_ipc`` on the wire)."""

    name = NAME
    title = "CUDA IPC ring"

    def wanted(self, delivery: Delivery | None, lends: bool) -> bool:
        """Asked only by a stream that delivers to the backend's device type (CUDA) and can
        say when each batch is given back (not a merge of shards)."""
        if delivery is None or not lends:
            return False
        ipc = device_ipc.backend()
        device_type = "cpu" if delivery.device is None else delivery.device.type
        return device_type == ipc.device_type

    def ask(self, opening: pb.SampleStreamRequest, local: bool) -> bool:
        ipc = device_ipc.backend()
        if not local:
            return False
        try:
            if not ipc.available():
                return False
            devices = ipc.visible_uuids()
        except Exception as exc:  # a broken driver: no IPC, host copies
            _log_once(f"CUDA IPC not asked for: the GPUs could not be listed ({exc})")
            return False
        opening.transports.append(NAME)
        opening.transport_asks[NAME] = json.dumps(
            {"host_id": host_id(), "pid": os.getpid(), "devices": devices}).encode()
        return True

    def open(self, header: pb.SampleResponse, context: SourceContext) -> Opened | None:
        offer = transport_offer(NAME, header)
        if offer is None:
            return None
        if context.refusal:
            return _refuse(context.refusal)
        if context.given_back is None:
            return _refuse("the stream cannot say when a batch is given back")
        ipc = device_ipc.backend()
        opened: list[Any] = []
        try:
            params = json.loads(offer.params)
            slots = int(params["slots"])
            if slots != context.window + 1:
                return _refuse(f"the ring has {slots} slots, this stream needs "
                               f"{context.window + 1}")
            device = ipc.local_device(params["uuid"])
            wanted = None if context.delivery is None else context.delivery.device
            if wanted is not None and wanted.type == device.type and _index(wanted) != device.index:
                return _refuse(f"the table's GPU is {device} here, the stream delivers to "
                               f"{wanted}")
            buffers = []
            for handle in params["buffers"]:
                buffers.append(ipc.open_buffer(handle, device))
                opened.append(buffers[-1])
            written = []
            for handle in params["written"]:
                written.append(ipc.open_event(handle, device))
                opened.append(written[-1])
            released = []
            for handle in params["released"]:
                released.append(ipc.open_event(handle, device))
                opened.append(released[-1])
            source = CudaIpcSource(ipc, device, params, buffers, written, released,
                                   context.given_back)
        except (device_ipc.IpcError, KeyError, TypeError, ValueError) as exc:
            ipc.close(opened)
            _log_once(f"CUDA IPC refused, batches come as host copies: {exc}")
            return _refuse(f"could not open the server's CUDA IPC ring ({exc})")
        mib = int(params["slot_bytes"]) / 2**20
        return Opened(source, transport_answer(NAME, True),
                      f"CUDA IPC: {slots} slots of {mib:.1f} MiB on {device}")


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def _refuse(reason: str) -> Opened:
    return Opened(None, transport_answer(NAME, False, reason), f"host copies: {reason}")


def _log_once(what: str) -> None:
    if not _LOGGED.is_set():
        _LOGGED.set()
        log.warning("%s", what)


CUDA_IPC = CudaIpcSources()
