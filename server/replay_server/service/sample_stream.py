"""``SampleStream``: batches to a learner, flow-controlled by its credits, through a batch sink.

One :class:`SampleStreamCall` per call. The learner's first message names the
table and batch size and grants ``credits`` (its prefetch window); each later
message grants one credit per batch it took (or more, widening the window).
The server draws batch ``k`` only once ``k < credits``, so it never runs more
than the window ahead. While a group is being sent the next is drawn, when
credits allow.

Priority updates ride on the credits: a message may carry the updates the
learner made since its previous one (``update``). The server applies them,
in the engine pool, before that message's credits count, so no batch those
credits allow is drawn before the update: a learner's next batch sees its
last update with no round trip of its own. A refused update ends the stream
with the status ``UpdatePriorities`` would have answered.

Leaving: the learner's last message says ``closing`` (after its last
updates). The server then draws nothing more, drops a draw still waiting
(for data, a rate limiter) and ends the call with OK, so the learner learns
that every message before was read and applied, without waiting on a draw.
A learner that half-closes without saying so gets what its credits allow
first (a client may send one request and half-close). A learner that says
in its first message that it will leave so (``stays_until_closing``) keeps
a stream with ``num_batches`` open after its last batch until it does (at
most ``server.response_timeout_s``): the updates of its last batches, made
after the server sent them, are read. (They were lost: the call ended with
the last batch sent, up to a window of batches before the learner took it.)

Queue tables: a learner that names a lease prefix (``lease``) takes each
group of batches under a lease of the table and says with its credits how
many batches it finished (``finished``); the groups finished are
acknowledged, and when the stream ends every group not finished returns to
the queue (:mod:`replay_server.service.stream_leases`). Such a stream stops
drawing once the learner half-closes (or leaves), and after its last batch (``num_batches``)
waits for the learner to finish them (at most the table's ``lease_timeout_s``)
before it ends.

Transports: batches leave through the call's *sink*: gRPC messages first,
and from the learner's acceptance on, the transport a registered sink kind
offered with the first batch when the learner asked for it (the same-host
shared-memory ring: :mod:`replay_server.service.ring_sink`). The call keeps
the credits, the draws and the memory; the sink says how many batches it
takes at once, what a group holds while sent, and makes the messages
(:mod:`replay_server.service.batch_sink`, :mod:`replay_server.service.sinks`).
A sink that cannot be made says why in the first batch (``transport_note``).

Memory: each group of batches reserves what it will hold (the batch and its
encoded chunks) from the server's :class:`~replay_server.service.budget.MemoryBudget`
before it is drawn, waiting for room when the budget is in use, and releases
it once its last chunk was sent; each such reservation (and the ring's) is a
part of the call's own, which gRPC's end-of-call callback releases however
the call ends (a reset or cut while a group is sent included); a batch over ``max_batch_mb`` ends the
stream with RESOURCE_EXHAUSTED (kind ``limit_exceeded``), and so does a row
over the message limit less its header (no message could carry it). A learner
message larger than the call declared ends it with INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import torch

from replay_proto.batch import SampleBatch, batch_nbytes
from replay_proto.sample_codec import HEADROOM, with_leased, with_note
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import MAX_BATCH_SIZE, Table, TableSet
from replay_server.errors import InvalidArgumentError, RateLimitedError
from replay_server.service.batch_sink import (
    BatchSink,
    Draw,
    MessageSink,
    SinkContext,
    StreamLimits,
)
from replay_server.service.budget import Reservation
from replay_server.service.calls import CallRunner
from replay_server.service import sinks
from replay_server.service.peer_log import peer_host
from replay_server.service.stream_leases import StreamLeases
from replay_server.service.stream_requests import messages_until, parse_first, update_table
from replay_server.service.status import (
    CLIENT_LOG,
    LimitExceededError,
    OverloadedError,
    ShuttingDownError,
)
from replay_server.service.waiting import draw


class SampleStreamCall:
    """One SampleStream call: reads credits, draws batches, sends them.

    Args:
        calls: runs engine work and ends the call with an error's status.
        tables: the tables served when the call started.
        limits: message size, budgets and shared-memory policy.
        requests: the learner's messages (raw bytes).
        context: the call's context.
        owner: the call's reservation (its learner's message): every group's memory and
            a sink's are parts of it, released with it when the call ends, however it
            ends (:mod:`replay_server.service.budget`).
    """

    def __init__(self, calls: CallRunner, tables: TableSet, limits: StreamLimits,
                 requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext, *,
                 owner: Reservation) -> None:
        self._calls = calls
        self._owner = owner
        self._max_request = owner.nbytes
        self._tables = tables
        self._limits = limits
        self._requests = requests
        self._context = context
        self._credits = 0
        self._window = 1
        self._group = 1  # batches drawn at once at most (the learner may change it)
        self._table: Table = None  # type: ignore[assignment]  # set by run()
        self._credit_event = asyncio.Event()
        self._client_done = False
        # Set when the learner leaves: its closing message, or a leased stream's half-close.
        self._leaving = asyncio.Event()
        self._leaving_wait: asyncio.Future | None = None  # one waiter for every draw
        self._refused: Exception | None = None  # a malformed learner message or update
        self._sink: BatchSink = MessageSink(limits.max_message_bytes)  # how batches leave
        self._offered: BatchSink | None = None  # offered with the first batch, not yet answered
        self._held: dict[asyncio.Future, Reservation] = {}  # each drawn group's memory
        self._sending: Reservation | None = None  # the memory of the group being sent
        self._pending: asyncio.Future | None = None  # the group being drawn, if any
        self._leases: StreamLeases | None = None  # a queue table's, if the learner named a prefix
        self._stays = False  # the learner leaves with `closing`: wait for it after the last batch

    def wake(self) -> None:
        """The server started draining: a stream waiting for credit ends now (UNAVAILABLE),
        so a learner that stopped taking batches does not hold the shutdown for its grace.
        Event loop only."""
        self._credit_event.set()

    @property
    def transport(self) -> str:
        """How batches travel now: the sink's name (``grpc`` until the learner accepts another
        transport's offer, such as ``shared_memory``)."""
        return self._sink.name

    async def run(self) -> AsyncGenerator[bytes, None]:
        """The call: open it from the learner's first message, then draw and send groups of
        batches as credit comes (drawing the next group while one is sent), then wait for
        what the learner still owes (leased rows finished, its last updates)."""
        calls, context = self._calls, self._context
        first = await self._open()
        if first is None:
            return
        request, table = first.request, self._table
        reader = asyncio.create_task(self._read())
        note = self._choose_sink(first)
        index = 0
        try:
            while True:
                if self._pending is None:
                    count = await self._next_count(request, table, index)
                    if count == 0:
                        break
                    reservation = await self._reserve(table, request, count, wait=True)
                    self._pending = self._start_draw(table, request, index, count,
                                                     index == 0, reservation)
                pending = self._pending
                if calls.draining:
                    pending.cancel()
                    await calls.fail(context, ShuttingDownError("the server is shutting down"))
                if not await self._drawn_unless_leaving(pending):
                    break  # the learner left while the draw waited: nothing more to send
                chunks, count, sink_note = await calls.settle(context, pending)
                self._sending = self._held.pop(pending, None)
                index += count
                self._pending = None
                note = sink_note or note
                if index == count:
                    self._mark_first(chunks, note)
                await self._draw_ahead(table, request, index)
                for chunk in chunks:
                    yield chunk  # a reset or cut here ends the call: _end releases the group
                del chunks
                self._release_sent()  # the group was handed to gRPC whole: its bytes are gone
            await self._finish(request)
        finally:
            self._end(reader)

    async def _open(self) -> pb.SampleStreamRequest | None:
        """Read and check the learner's first message (``None``: it sent none): the table,
        the batch's size against the limit, a lease, a first priority update, the credits."""
        calls, context = self._calls, self._context
        try:
            first_raw = await self._requests.__anext__()
        except StopAsyncIteration:
            return None
        if len(first_raw) > self._max_request:
            await calls.fail(context, self._oversized(first_raw))
        first = await calls.run(context, parse_first, first_raw)
        request = first.request
        table = await calls.run(context, self._tables.__getitem__, request.table)
        self._table = table
        await self._check_sizes(table, request.batch_size)
        self._group = max(1, request.batches_per_message)
        self._stays = first.stays_until_closing
        try:
            self._leases = StreamLeases.open(table, first.lease, request.batch_size)
            if first.finished:
                raise InvalidArgumentError("the first SampleStream message cannot finish batches")
        except InvalidArgumentError as exc:
            await calls.fail(context, exc)
        if first.HasField("update"):
            try:
                await self._apply(first.update)
            except Exception as exc:
                await calls.fail(context, exc)
        self._credits = first.credits
        self._window = max(first.credits, first.window)  # a ring gets window + 1 slots
        if first.closing:  # a learner leaving at once: its update applied, nothing drawn
            self._leaving.set()
        return first

    def _choose_sink(self, first: pb.SampleStreamRequest) -> str:
        """Ask the registered sink kinds (:data:`~replay_server.service.sinks.SINKS`, in order)
        for a transport the first batch offers; why none (a note the first batch carries;
        "" when none was asked for, or one is offered)."""
        context = SinkContext(first, self._limits, self._owner, self._window, self._log,
                              self._table)
        notes = []
        for kind in sinks.SINKS.values():
            sink, note = kind.open(context)
            if sink is not None:
                self._offered = sink
                return ""
            if note:
                notes.append(note)
        return "; ".join(notes)

    def _mark_first(self, chunks: list[bytes], note: str) -> None:
        """Mark the first group's first chunk: why no transport is offered (``note``), and that its
        rows are leased."""
        if note:
            chunks[0] = with_note(chunks[0], note)
        if self._leases is not None:
            chunks[0] = with_leased(chunks[0])

    async def _draw_ahead(self, table: Table, request: pb.SampleRequest, index: int) -> None:
        """Start drawing the group after ``index`` while this one is sent, if the learner's
        credit and the memory budget allow it now (else the loop draws it when they do)."""
        ahead = await self._next_count(request, table, index, wait=False)
        if ahead:
            reservation = await self._reserve(table, request, ahead, wait=False)
            if reservation is not None:
                self._pending = self._start_draw(table, request, index, ahead, False,
                                                 reservation)

    async def _finish(self, request: pb.SampleRequest) -> None:
        """After the last batch: end with a learner message refused meanwhile, wait for a
        leased stream's batches to be finished, and read a staying learner's last updates."""
        calls, context = self._calls, self._context
        if self._refused is not None:
            await calls.fail(context, self._refused)
        if self._leases is not None:
            await self._leases.wait_finished(
                self._credit_event, self._table.config.effective_lease_timeout_s,
                lambda: (self._client_done or self._leaving.is_set() or calls.draining
                         or self._refused is not None))
        if self._stays and request.num_batches:
            # Read the learner's updates of the last batches until it leaves.
            await messages_until(
                self._credit_event, self._limits.closing_wait_s,
                lambda: (self._leaving.is_set() or self._client_done or calls.draining
                         or self._refused is not None))
            if self._refused is not None:
                await calls.fail(context, self._refused)

    def _end(self, reader: asyncio.Task) -> None:
        """Let go of everything the call holds, however it ended: its leases (soon), a draw
        under way, reserved memory, the reader of the learner's messages, the sinks."""
        if self._leases is not None:
            self._leases.end_soon(self._calls.executor)
        pending = self._pending
        if pending is not None and not pending.done():
            pending.cancel()
        elif pending is not None and not pending.cancelled():
            pending.exception()  # retrieved, so asyncio does not log it as lost
        for held in self._held.values():
            held.release()
        self._release_sent()
        reader.cancel()
        if self._leaving_wait is not None:
            self._leaving_wait.cancel()
        offered, self._offered = self._offered, None
        if offered is not None:
            offered.close()
        self._sink.close()

    async def _drawn_unless_leaving(self, pending: asyncio.Future) -> bool:
        """Wait for the draw ``pending`` unless the learner leaves first (a draw may wait long
        for data or a rate limiter); whether the draw is done. One waiter on the leaving
        event serves every draw of the stream (about 4 us a group)."""
        if pending.done():
            return True
        if self._leaving_wait is None:
            self._leaving_wait = asyncio.ensure_future(self._leaving.wait())
        await asyncio.wait({pending, self._leaving_wait}, return_when=asyncio.FIRST_COMPLETED)
        return pending.done()

    # ------------------------------------------------------------ memory

    def _release_sent(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.release()

    @staticmethod
    def _batch_bytes(table: Table, batch_size: int) -> int:
        return table.batch_nbytes(batch_size) if 1 <= batch_size <= MAX_BATCH_SIZE else 0

    async def _check_sizes(self, table: Table, batch_size: int) -> int:
        """The bytes of a batch of ``batch_size`` (0 while the table has no schema), or end the
        call (RESOURCE_EXHAUSTED, ``limit_exceeded``) if the batch is over ``max_batch_mb`` or
        one row over the message limit less its header: a batch travels in messages of whole
        rows (the first over gRPC even with a ring), so such a row could never be sent."""
        batch_bytes = self._batch_bytes(table, batch_size)
        if batch_bytes > self._limits.max_batch_bytes:
            await self._calls.fail(self._context, self._too_large(table, batch_size, batch_bytes))
        row = table.batch_nbytes(1) if batch_bytes else 0
        largest = self._limits.max_message_bytes - HEADROOM
        if row > largest:
            await self._calls.fail(self._context, LimitExceededError(
                f"table {table.name!r}: one row (or slice) of a sample is about {row >> 10} KiB, "
                f"over the {self._limits.max_message_bytes >> 20} MiB message limit less its "
                f"header ({largest >> 10} KiB); raise server.max_message_mb (and the client's "
                f"max_message_mb)"))
        return batch_bytes

    def _too_large(self, table: Table, batch_size: int, nbytes: int) -> LimitExceededError:
        return LimitExceededError(
            f"table {table.name!r}: a batch of {batch_size} is about {nbytes >> 20} MiB, over "
            f"server.max_batch_mb = {self._limits.max_batch_bytes >> 20}; stream smaller "
            f"batches")

    def _oversized(self, raw: bytes) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"a SampleStream message of {len(raw)} bytes is larger than the call declared "
            f"({self._max_request} bytes, metadata replay-request-bytes)")

    async def _reserve(self, table: Table, request: pb.SampleRequest, count: int,
                       wait: bool) -> Reservation | None:
        """The memory the next group will hold, reserved (waiting for room if ``wait``).

        What a group holds is the sink's to say (gRPC messages: the batches
        and their encoded chunks; a ring: only ids, weights and probabilities
        beside it). ``None``: no room now (``wait`` False).
        """
        batch_bytes = await self._check_sizes(table, request.batch_size)  # (a schema fixed since)
        # An invalid batch_size is the table's to refuse (INVALID_ARGUMENT) when it draws.
        rows = request.batch_size if 1 <= request.batch_size <= MAX_BATCH_SIZE else 0
        extras = batch_nbytes(0, rows, table.config.slice_len, table.config.n_step)
        nbytes = self._sink.held_bytes(count, batch_bytes, extras)
        purpose = f"SampleStream: {count} batch(es) of {request.batch_size} from {table.name!r}"
        budget = self._limits.budget
        owner = self._owner
        try:
            return (await budget.wait(nbytes, purpose, owner=owner,
                                      peer=peer_host(self._context.peer()),
                                      bounded=False) if wait
                    else budget.reserve(nbytes, purpose, owner=owner))
        except OverloadedError:
            return None
        except LimitExceededError as exc:
            await self._calls.fail(self._context, exc)

    # ------------------------------------------------------------ credits

    async def _read(self) -> None:
        """Take credits and the answer to a transport's offer from the learner's messages.

        A malformed message ends the stream with INVALID_ARGUMENT (after the
        batch being drawn, if any): the learner speaks another protocol.
        """
        try:
            async for raw in self._requests:
                if len(raw) > self._max_request:
                    self._refused = self._oversized(raw)
                    return
                try:
                    message = pb.SampleStreamRequest.FromString(raw)
                except Exception as exc:
                    self._refused = InvalidArgumentError(
                        f"malformed SampleStream credit message: {exc}")
                    return
                if (message.credits < 0 or message.HasField("request")
                        or message.batches_per_message < 0 or message.finished < 0
                        or message.lease):
                    self._refused = InvalidArgumentError(
                        "a later SampleStream message may only grant credits >= 0, carry a "
                        "priority update, set batches_per_message >= 0, finish batches >= 0 "
                        "or answer a shared-memory offer")
                    return
                if message.finished and self._leases is not None:
                    try:
                        self._leases.finish(message.finished)
                    except InvalidArgumentError as exc:
                        self._refused = exc
                        return
                if message.HasField("update"):
                    try:
                        await self._apply(message.update)  # before its credits count
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        self._refused = exc
                        return
                if message.batches_per_message:
                    self._group = message.batches_per_message
                self._credits += message.credits
                if self._offered is not None:
                    self._on_answer(message)
                if message.closing:
                    self._leaving.set()
                self._credit_event.set()
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        finally:
            self._client_done = True
            if self._leases is not None:
                self._leaving.set()
            self._credit_event.set()

    async def _apply(self, update: pb.UpdatePrioritiesRequest) -> None:
        """Apply a priority update of the stream's table in the engine pool (raises its error)."""
        table = self._table
        if update.table and update.table != table.name:
            raise InvalidArgumentError(
                f"a SampleStream of table {table.name!r} carried a priority update of table "
                f"{update.table!r}; update other tables with UpdatePriorities")
        await self._calls.change(self._context, update_table, table, update, aborting=False)

    def _on_answer(self, message: pb.SampleStreamRequest) -> None:
        """The learner's answer to the offered transport, if ``message`` holds it: from now
        on batches go through it (accepted), or stay on gRPC messages (the sink closed)."""
        offered = self._offered
        accepted = None if offered is None else offered.answered(message)
        if accepted is None:
            return
        self._offered = None
        if accepted:
            self._sink = offered  # type: ignore[assignment]  # (not None: answered)

    async def _next_count(self, request: pb.SampleRequest, table: Table, index: int,
                          wait: bool = True) -> int:
        """How many batches to draw next at ``index`` (0: the stream is over or, if not wait, no credit)."""
        remaining = request.num_batches - index if request.num_batches else MAX_BATCH_SIZE
        if remaining <= 0 or self._refused is not None:
            return 0
        if self._leaving.is_set():
            return 0  # the learner left: draw nothing more (it would have to give it back)
        while self._credits <= index:
            if not wait or self._client_done or self._leaving.is_set():
                return 0
            if self._calls.draining:
                await self._calls.fail(self._context,
                                       ShuttingDownError("the server is shutting down"))
            self._credit_event.clear()
            await self._credit_event.wait()
        if self._refused is not None:
            return 0
        wanted = min(self._group, remaining, self._credits - index)
        return self._sink.group(wanted, request.batch_size,
                                self._batch_bytes(table, request.batch_size))

    # ------------------------------------------------------------ drawing (engine threads)

    def _start_draw(self, table: Table, request: pb.SampleRequest, index: int, count: int,
                    offer: bool, reservation: Reservation | None) -> asyncio.Future:
        """Draw in the engine's pool, waiting (without a thread) while the rate limiter holds
        it (or, with ``wait_for_data``, while the table is empty; at most ``wait_timeout_s``);
        ``reservation`` (the group's memory) is released once the group was sent."""
        limit = request.wait_timeout_s if request.wait_timeout_s > 0 else None
        future = asyncio.ensure_future(self._calls.change(
            self._context, self._draw, table, request, index, count, offer, aborting=False,
            time_remaining=None if limit is None else lambda: limit))
        if reservation is not None:
            self._held[future] = reservation
        return future

    def _draw(self, table: Table, request: pb.SampleRequest, index: int, count: int,
              offer: bool) -> tuple[str, tuple[list[bytes], int, str]]:
        """The group at ``index`` through the current sink; the first one (``offer``) also
        offers the transport chosen when the stream opened (or says why it cannot)."""
        chunks, count, batch = self._sink.send(self._drawer(table, request, index), index, count)
        note = ""
        offered = self._offered
        if offer and offered is not None:
            head, note = offered.offer(batch, request.batch_size)
            if head:
                chunks[0] = head + chunks[0]
            else:
                self._offered = None
                offered.close()
        return table.name, (chunks, count, note)

    def _drawer(self, table: Table, request: pb.SampleRequest, index: int) -> Draw:
        """The draw of the group at ``index`` a sink calls: under the stream's lease (a queue
        table's), waiting for data if asked; a group the rate limiter holds back is drawn as
        a single batch."""
        wait, leases = request.wait_for_data, self._leases

        def draw_group(count: int, out: dict[str, torch.Tensor] | None = None
                       ) -> tuple[SampleBatch, int]:
            lease = None if leases is None else leases.request(index)
            if leases is not None:
                leases.settle()  # acknowledge the groups the learner finished
            try:
                batch = draw(table, request.batch_size * count, wait_for_data=wait, out=out,
                             lease=lease)
            except RateLimitedError:
                if count == 1:
                    raise
                count = 1
                batch = draw(table, request.batch_size, wait_for_data=wait, out=out,
                             lease=lease)
            if leases is not None and lease is not None:
                leases.drawn(lease, count)
            return batch, count

        return draw_group

    def _log(self, topic: str, level: int, what: str) -> None:
        """A line about this stream's client (rate-limited per client: see ``peer_log``)."""
        peer = self._context.peer()
        CLIENT_LOG.log(peer, topic, level, "SampleStream from %s: %s", peer, what)
