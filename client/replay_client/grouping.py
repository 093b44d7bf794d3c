"""How a learner's stream groups batches into messages when the learner does not say.

Python gRPC moves a few thousand messages a second whatever their size, so a
stream of small batches (17 floats x 256 rows is 23 KB) is bound by messages,
not bytes: one batch per message reached 2.4x Reverb's dataset where eight per
message reached 9.7x (``docs/benchmarks.md``). Large batches (Atari: 7 MB) are
bound by bytes and gain nothing from grouping; they keep one batch per
message and may use the same-host shared-memory ring.

:func:`choose` is the rule a stream applies when ``batches_per_message`` is
left to it (``None``), once its first batch has arrived and its size is
known (so a learner that starts before the first insert is grouped too; the
first batch travels alone, and may bring a shared-memory ring's offer, which
grouped small batches decline):

* a batch of at most :data:`GROUP_BELOW_BYTES` is grouped: as many batches per
  message as fill :data:`GROUP_TARGET_BYTES`, at most :data:`MAX_GROUP` (a sharded
  stream's shard, whose batches are chunks of one ``n``-th of the learner's
  batch, groups up to ``n * MAX_GROUP`` of them: the rows one server's message
  would carry, so two shards cost their servers no more messages than one);
* with ``prefetch`` left to it too, the window holds two groups (the server
  draws one while the learner consumes the other): ``prefetch = 2 * k``, at
  least 2; a ``prefetch`` the learner gave is kept as the bound, and groups
  shrink to fit two of them in it (``k = prefetch // 2``).

Grouped batches are drawn together, so they do not see priority updates made
between them: the same staleness any prefetch of that many batches has.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay_feed.options import DEFAULT_PREFETCH

GROUP_BELOW_BYTES = 1 << 20
"""Batches up to this size (1 MiB) are grouped."""

GROUP_TARGET_BYTES = 2 << 20
"""A group fills about this many bytes (2 MiB: inside gRPC's fast 1-4 MB range)."""

MAX_GROUP = 8
"""Batches per message at most, when chosen automatically."""

@dataclass(frozen=True, slots=True)
class Grouping:
    """What a stream uses: its window, batches per message, and why (for ``stream.stats.notes``)."""

    prefetch: int
    batches_per_message: int
    note: str = ""


def choose(batch_bytes: int | None, prefetch: int | None, most: int = MAX_GROUP) -> Grouping:
    """The grouping for batches of ``batch_bytes`` (``None``: unknown) and a learner's ``prefetch``.

    Args:
        batch_bytes: bytes of one batch (rows, ids and weights); ``None`` when
            the table's schema could not be read (then nothing is grouped).
        prefetch: the learner's window, or ``None`` to choose it.
        most: batches per message at most (a shard's chunks: ``n * MAX_GROUP``).
    """
    if batch_bytes is None or batch_bytes > GROUP_BELOW_BYTES:
        return Grouping(prefetch or DEFAULT_PREFETCH, 1)
    k = max(1, min(most, GROUP_TARGET_BYTES // max(1, batch_bytes)))
    if prefetch is not None:
        k = max(1, min(k, prefetch // 2))
        window = prefetch
    else:
        window = max(DEFAULT_PREFETCH, 2 * k)
    if k == 1:
        return Grouping(window, 1)
    return Grouping(window, k, f"batches_per_message={k} chosen for {batch_bytes / 1024:.0f} KiB "
                               f"batches (prefetch {window}; see replay_client.grouping)")


def given(batches_per_message: int | None, prefetch: int | None) -> Grouping:
    """The grouping of a learner that gave ``batches_per_message`` (``None``: left to
    :func:`choose`, at the first batch) and ``prefetch`` (``None``: the default window).

    A group of more than one batch travels in gRPC messages (a shared-memory
    descriptor per batch would cost more than the small rows grouping is for),
    and the window holds two groups, so the server draws one while the learner
    consumes the other; a ``prefetch`` raised for that is said in the note.
    """
    window = prefetch or DEFAULT_PREFETCH
    if batches_per_message is None or batches_per_message <= 1:
        return Grouping(window, 1)
    wide = max(window, 2 * batches_per_message)
    note = (f"prefetch raised to {wide}: two groups of batches_per_message={batches_per_message} "
            f"fit the window" if prefetch is not None and wide > prefetch else "")
    return Grouping(wide, batches_per_message, note)
