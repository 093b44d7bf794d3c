"""A table's lock held by another thread, as a long call would hold it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from replay_server import Table


@contextmanager
def lock_held_elsewhere(table: Table) -> Iterator[None]:
    """Within the block, another thread holds ``table``'s lock (released when it ends)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with table._lock:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join()
