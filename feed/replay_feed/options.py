"""``StreamOptions``: what a learner asks of a stream, built and checked once for every entry.

Three entries open a learner's stream: ``ReplayClient.stream`` (one server),
the sharded client's ``stream`` and ``EmbeddedServer.stream`` (in process).
They take the same keywords, or a ready ``StreamOptions``, and hand the value
to the feed; nothing downstream checks them again. A bad value raises
:class:`StreamOptionsError` (a ``ValueError``) naming the option and the
value; each side turns it into its own ``InvalidArgumentError``.

Options a transport cannot honour are not errors but notes: an in-process
stream has no connection to lose (``reconnect``), no messages to group
(``batches_per_message``) and no ring to map (``shared_memory``);
``stream.stats.notes`` says what was decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from replay_feed.delivery import Delivery, resolve_delivery
from replay_proto.scalars import is_int, is_real

DEFAULT_PREFETCH = 2
"""Batches ahead of the learner when nothing else is chosen (``prefetch=None``)."""

DEFAULT_MEMORY_MB = 256
"""What a stream may hold in batches in flight or buffered, unless told (see ``memory_mb``)."""

RECONNECT_S = 60.0
"""Seconds a lost stream keeps trying to resume, unless told (``reconnect_s``): long enough
for a server's restart with its restore (``make serve`` stopped and started by hand took
10-20 s to SERVING; a stream gave up after the client's 10 s ``max_retry_s`` before)."""


class StreamOptionsError(ValueError):
    """A stream option is not valid (the message names it and the value)."""


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """A learner's stream options (the keywords of every ``stream`` entry).

    Attributes:
        prefetch: batches in flight or buffered ahead of the learner (>= 1);
            ``None``: chosen by the stream (:data:`DEFAULT_PREFETCH`, or two groups of grouped
            batches, grown over a slow link; see ``docs/learner.md``).
        device: where batches go (``"cuda"``, ``"cuda:1"``, a ``torch.device``);
            ``None`` or ``"cpu"``: they stay on the host.
        pin_memory: ``"auto"`` pins when an accelerator is present; ``True``
            without one is an error; ``False`` never pins.
        transform: applied to each batch on the stream's thread, before
            pinning and the device copy; may return any structure of tensors.
        num_batches: batches in all (0: until the loop stops).
        batches_per_message: batches the server may draw at once and send in
            one message (gRPC); ``None``: chosen once the first batch's size
            is known (small batches grouped, large ones not).
        shared_memory: use a same-host shared-memory ring when the server offers one.
        reconnect: resume after a lost connection instead of raising.
        reconnect_s: seconds a lost stream keeps trying to resume before it fails;
            ``None``: :data:`RECONNECT_S` (a server's restart, restore included), or
            the client's ``max_retry_s`` where that is longer. A server that never
            answered this client gets only its connect window, as any call.
        wait: wait while the table cannot serve a batch (``False``: an empty
            table ends the stream with ``EmptyTableError``).
        wait_timeout: seconds one batch may wait for data before the stream
            ends with ``DeadlineExceededError`` (``None``: no limit).
        memory_mb: the most the stream's batches in flight or buffered may
            take (its window is never grown past it; a window the learner
            asked for with ``prefetch`` is kept as given).

    Raises:
        StreamOptionsError: a value of the wrong type or out of range.
    """

    prefetch: int | None = None
    device: Any = None
    pin_memory: bool | str = "auto"
    transform: Callable[[Any], Any] | None = None
    num_batches: int = 0
    batches_per_message: int | None = None
    shared_memory: bool = True
    reconnect: bool = True
    reconnect_s: float | None = None
    wait: bool = True
    wait_timeout: float | None = None
    memory_mb: float = DEFAULT_MEMORY_MB

    def __post_init__(self) -> None:
        for name, low, optional in (("prefetch", 1, True), ("num_batches", 0, False),
                                    ("batches_per_message", 0, True)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not is_int(value, numpy=True) or value < low:
                raise StreamOptionsError(f"{name} must be an integer >= {low}"
                                         f"{' or None' if optional else ''}, got {value!r}")
        for name in ("shared_memory", "reconnect", "wait"):
            if not isinstance(getattr(self, name), bool):
                raise StreamOptionsError(f"{name} must be True or False, "
                                         f"got {getattr(self, name)!r}")
        if not (isinstance(self.pin_memory, bool) or self.pin_memory == "auto"):
            raise StreamOptionsError(
                f"pin_memory must be True, False or 'auto', got {self.pin_memory!r}")
        if self.transform is not None and not callable(self.transform):
            raise StreamOptionsError(
                f"transform must be callable, got {type(self.transform).__name__}")
        if self.wait_timeout is not None and not (is_real(self.wait_timeout)
                                                  and self.wait_timeout > 0):
            raise StreamOptionsError(
                f"wait_timeout must be a number of seconds > 0 or None, got {self.wait_timeout!r}")
        if self.reconnect_s is not None and not (is_real(self.reconnect_s)
                                                 and 0 < self.reconnect_s < float("inf")):
            raise StreamOptionsError(
                f"reconnect_s must be a number of seconds > 0 or None, got {self.reconnect_s!r}")
        if not (is_real(self.memory_mb) and self.memory_mb > 0):
            raise StreamOptionsError(f"memory_mb must be a number > 0, got {self.memory_mb!r}")

    @classmethod
    def build(cls, options: StreamOptions | None = None, /,
              **keywords: Any) -> StreamOptions:
        """``options`` (or the defaults) with ``keywords`` set, checked.

        Raises:
            StreamOptionsError: an unknown keyword (the message lists the
                known ones), or a bad value.
        """
        if options is not None and not isinstance(options, StreamOptions):
            raise StreamOptionsError(
                f"options must be a StreamOptions, got {type(options).__name__}")
        unknown = sorted(set(keywords) - set(NAMES))
        if unknown:
            raise StreamOptionsError(f"unknown stream option(s) {', '.join(unknown)}; the "
                                     f"options are {', '.join(NAMES)}")
        base = options if options is not None else cls()
        return replace(base, **keywords) if keywords else base

    def delivery(self) -> Delivery:
        """Where batches go and whether they are pinned, checked against this process.

        Raises:
            StreamOptionsError: ``pin_memory=True`` or a device without a
                matching accelerator (:func:`~replay_feed.delivery.resolve_delivery`).
        """
        try:
            return resolve_delivery(self.device, self.pin_memory)
        except ValueError as exc:
            raise StreamOptionsError(str(exc)) from None


NAMES = tuple(f.name for f in fields(StreamOptions))
"""Every option's name, in declaration order."""
