"""Same-host inserts and samples through shared memory: one region per call stream, in /dev/shm.

An actor on the server's host need not push its rows through gRPC: an
insert of 256 Atari rows (7.2 MB) cost the server about 9 ms of CPU as a
chunked call on the 2-core machine (the kernel's socket copies, gRPC's
reassembly, the chunks joined), against one copy into the table from
shared memory. A client's insert call stream asks for a region
(``insert_region``); if the client runs on this host (same boot id) and the
server offers shared memory, :meth:`CallRegion.open` creates one slot of
the bytes asked for in /dev/shm (reserved from ``shared_memory_mb``, beside
the learners' rings) and offers it. The client maps it, unlinks its name and
answers (``region_answer``); from then on a request says only that an Insert
request of ``n`` bytes lies at the region's start (``insert_in_region``), and
the server decodes it from the mapping (views, no copy) and inserts it as
the unary call would, in the engine pool. The table copies the rows into its
storage; a write-ahead log encodes its record from them before the answer
goes out; so nothing reads the region after the answer, and the client
writes the next insert there only once it has its answer (one insert at a
time on the stream).

A client's sample stream uses its region the other way round
(:mod:`~replay_server.service.region_sample`): the server gathers a batch
straight into it and answers only where each tensor lies; the client copies
the batch out before its next request.

Lifetime and bounds: a region lives as long as its stream (:meth:`close`
unlinks a name not yet unlinked and releases the reservation); a stream has
at most one (a new ``insert_region`` replaces it); the name follows the
rings' pattern, so a server killed between creating it and the client
mapping it leaves nothing a later server's sweep does not remove. A region
larger than :data:`MAX_REGION_BYTES`, or than the shared-memory budget left,
is refused (the client sends chunks); an ``insert_in_region`` without a
region or past its end is refused INVALID_ARGUMENT, nothing stored.

A client writing the region while the server reads it can corrupt only its
own insert: the header is parsed once, and every tensor view is checked
against the region's bounds (``decode_insert``).

Thread-safety: :meth:`open` runs in an engine thread (reserving a region's pages takes a
while), the others on the event loop; :meth:`close` may come while :meth:`open` runs (the
call ended), and whichever comes second removes the region. The bytes :meth:`request`
returns are read in an engine thread.
"""

from __future__ import annotations

import logging
import threading

from replay_feed.shared_ring import SharedMemoryError, SharedRing, host_id
from replay_proto.v1 import replay_pb2 as pb
from replay_server.errors import FailedPreconditionError, InvalidArgumentError
from replay_server.service.budget import MemoryBudget, Reservation
from replay_server.service.status import LimitExceededError

log = logging.getLogger("replay_server")

MAX_REGION_BYTES = 256 << 20
"""The largest region one call stream may have (larger inserts travel chunked)."""


class CallRegion:
    """One call stream's shared-memory region for inserts and samples (see the module docstring).

    Args:
        enabled: the server offers shared memory (``server.shared_memory``).
        budget: what every ring and region in /dev/shm is reserved from.
    """

    def __init__(self, enabled: bool, budget: MemoryBudget) -> None:
        self._enabled = enabled
        self._budget = budget
        self._ring: SharedRing | None = None
        self._reservation: Reservation | None = None
        self._mapped = False  # the client said it mapped the region
        self._lock = threading.Lock()
        self._closed = False  # the stream ended: no region any more

    def open(self, request: pb.SharedInsertRegion) -> pb.SharedMemoryOffer:
        """Create a region of ``request.bytes`` (replacing the stream's) and offer it.

        Raises:
            FailedPreconditionError: shared memory is off, or the client is on another host.
            LimitExceededError: the region is larger than :data:`MAX_REGION_BYTES` or the
                shared-memory budget left; or /dev/shm has no room for it.
            InvalidArgumentError: ``bytes`` is not positive.
        """
        self._drop()
        if not self._enabled:
            raise FailedPreconditionError("the server has shared_memory = false: no "
                                          "shared-memory region for inserts")
        if request.host_id != host_id():
            raise FailedPreconditionError("the client runs on another host: no shared-memory "
                                          "region for inserts")
        wanted = request.bytes
        if wanted <= 0:
            raise InvalidArgumentError(f"insert_region: bytes must be > 0, not {wanted}")
        if wanted > MAX_REGION_BYTES:
            raise LimitExceededError(f"insert_region: {wanted:,} bytes is more than a call "
                                     f"stream's region may have ({MAX_REGION_BYTES:,})")
        size = SharedRing.size_for(1, wanted)
        reservation = self._budget.reserve(size, "a shared-memory region for inserts")
        try:
            ring = SharedRing.create(1, wanted)
        except SharedMemoryError as exc:
            reservation.release()
            raise LimitExceededError(f"no shared-memory region for inserts: {exc}") from None
        with self._lock:
            ended = self._closed
            if not ended:
                self._ring, self._reservation, self._mapped = ring, reservation, False
        if ended:  # the stream ended while the region was made: never offered
            ring.unlink()
            ring.close()
            reservation.release()
            raise InvalidArgumentError("the call stream ended while its region was made")
        return pb.SharedMemoryOffer(name=ring.name, token=ring.token, slots=1,
                                    slot_bytes=ring.slot_bytes, header_bytes=ring.header_bytes)

    def answered(self, answer: pb.SharedMemoryAnswer) -> pb.SharedMemoryAnswer:
        """The client mapped the region offered (or could not: it is dropped); echoed back.

        Raises:
            InvalidArgumentError: no region was offered on this stream.
        """
        ring = self._ring
        if ring is None:
            raise InvalidArgumentError("region_answer without an insert_region offered before it")
        ring.unlink()  # both sides hold a mapping now (or never will): the name can go
        if answer.accepted:
            self._mapped = True
        else:
            log.info("a client could not map its insert region (%s); it sends inserts chunked",
                     answer.reason)
            self._drop()
        return pb.SharedMemoryAnswer(accepted=answer.accepted, reason=answer.reason)

    def request(self, length: int) -> memoryview:
        """The bytes of the Insert request the client wrote at the region's start.

        Raises:
            InvalidArgumentError: no region is mapped on this stream, or ``length`` does not
                fit it.
        """
        ring = self._ring
        if ring is None or not self._mapped:
            raise InvalidArgumentError("insert_in_region without a region mapped on this "
                                       "stream (insert_region, then region_answer)")
        if not 0 < length <= ring.slot_bytes:
            raise InvalidArgumentError(f"insert_in_region: {length:,} bytes do not fit the "
                                       f"region of {ring.slot_bytes:,} bytes")
        return memoryview(ring.slot(0)[:length].numpy())

    def mapped(self) -> SharedRing | None:
        """The region, once the client said it mapped it (``None``: none yet)."""
        ring = self._ring
        return ring if ring is not None and self._mapped else None

    def close(self) -> None:
        """The stream ended: drop the region, and any :meth:`open` still making one drops
        it too. Idempotent."""
        with self._lock:
            self._closed = True
        self._drop()

    def _drop(self) -> None:
        """Drop the region (its name unlinked, its reservation released), if there is one."""
        with self._lock:
            ring, self._ring = self._ring, None
            reservation, self._reservation = self._reservation, None
        if ring is not None:
            ring.unlink()
            ring.close()
        if reservation is not None:
            reservation.release()
