"""``BatchStream``: the learner's iterator over a feed, and the thread that fills it.

See :mod:`replay_feed.core` for what happens to each batch on the way.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from replay_feed.core import FeedCore, Source
from replay_feed.delivery import Delivery

log = logging.getLogger("replay.feed")


class BatchStream:
    """The learner's iterator over a feed: ``for batch in stream: ...``.

    Breaking out of the loop, leaving a ``with`` block, :meth:`close` or
    garbage collection stops the background thread, cancels the source and
    releases its buffers (shared memory included). Errors of the source
    reach the learner as the exceptions the source raised, after the
    batches that came before them.

    Attributes:
        stats: batches and bytes delivered, time waited, transport, notes.
    """

    def __init__(self, core: FeedCore, source: Source, name: str) -> None:
        self._core = core
        self._source = source
        self._name = name
        self.stats = core.stats
        self.stats.notes.append(core.delivery.note)
        self._thread = threading.Thread(
            target=_produce, args=(core, source), name=f"replay-stream-{name}", daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def delivery(self) -> Delivery:
        """What was decided about device and pinning."""
        return self._core.delivery

    @property
    def pinned(self) -> bool:
        """Whether batches (or the host side of their device copies) are page-locked."""
        return self._core.delivery.pin

    @property
    def transport(self) -> str:
        """How batches travel: ``shared_memory``, ``grpc`` or ``in_process``."""
        return self.stats.transport

    def __iter__(self):  # type: ignore[no-untyped-def]
        try:
            while True:
                yield self.__next__()
        except StopIteration:
            return
        finally:
            self.close()

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            batch = self._core.take()
            if self.stats.batches == 1:
                log.info("stream %s: %s (%s)", self._name, self.stats.transport,
                         "; ".join(self.stats.notes))
            return batch
        except StopIteration:
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Stop the background work and release buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._core.stop()
        self._source.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("stream thread %s did not stop within %.0f s", self._thread.name, timeout)
        self._core.release()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=2.0)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _produce(core: FeedCore, source: Source) -> None:
    try:
        source.run(core)
    except BaseException as exc:
        if core.stopping.is_set():
            core.finish()
        else:
            core.fail(exc)
    else:
        core.finish()
