"""Which TorchRL tests the conformance figure counts, and which it does not, with why.

A test is *in scope* when, with TorchRL's own classes, it passes, builds one
of the public buffer classes, writes only TensorDicts to it (tests writing
other data are counted apart, as "other data"), and builds it only from
parts that a table on a server can stand for. :data:`OUT_OF_SCOPE_PARTS`
lists the TorchRL parts that have no server counterpart; ``RemoteReplayBuffer``
refuses each with an error naming the alternative, and the tests that
build with them are counted apart, by part.

In scope, a test is *not applicable* when its own code reads private state
of TorchRL's buffers, storages, samplers or writers (``rb._storage``,
``rb.writer._cursor``, ``sampler._cache``: recorded in the reference run,
the attributes named), or when :data:`NOT_APPLICABLE` lists it, with its
reason. The list is kept short: a test whose behaviour a TorchRL user's
code could depend on is never listed; it passes or fails.
"""

from __future__ import annotations

import re

OUT_OF_SCOPE_PARTS: dict[str, str] = {
    "sampler=SamplerWithoutReplacement": "epochs without replacement (tables sample with "
                                         "replacement, or hand rows out once: fifo)",
    "sampler=SliceSamplerWithoutReplacement": "slice epochs without replacement",
    "sampler=ConsumingSampler": "TorchRL's consuming sampler (tables: max_times_sampled, fifo)",
    "sampler=StalenessAwareSampler": "TorchRL's staleness-aware sampler",
    "sampler=PromptGroupSampler": "TorchRL's LLM prompt-group sampler",
    "sampler=SamplerEnsemble": "TorchRL's ensembles of samplers",
    "sampler=StreamingSliceSampler": "TorchRL's streaming slice sampler",
    "writer=TensorDictMaxValueWriter": "a writer that keeps the highest-valued rows",
    "writer=ImmutableDatasetWriter": "a writer that refuses writes (offline datasets)",
    "writer=WriterEnsemble": "TorchRL's ensembles of writers",
    "storage=StorageEnsemble": "TorchRL's ensembles of storages",
    "storage=LazyStackStorage": "ragged and non-tensor entries (a table's column has one "
                                "shape and dtype)",
    "storage.ndim=2": "multi-dimensional storages (a table's rows are one-dimensional)",
    "storage.ndim=3": "multi-dimensional storages (a table's rows are one-dimensional)",
    "ensemble=ReplayBufferEnsemble": "TorchRL's ensembles of buffers (they compose each "
                                     "buffer's private storage and sampler)",
    "option=sample_unit": "TorchRL's sample units (sequence windows around anchors)",
    "option=checkpointer": "TorchRL's storage checkpointers",
    "option=consume_after_n_samples": "TorchRL's consume-after-n option (tables: "
                                      "max_times_sampled)",
    "option=dim_extend": "extending along another dimension of a multi-dim storage",
    "option=service_backend": "TorchRL's own buffer services (Ray)",
    "option=transport": "TorchRL's own buffer transports",
}
"""TorchRL buffer parts with no server counterpart: ``part`` (as
:func:`tests.conformance.swap.parts_of` names it) -> what it is."""

NOT_APPLICABLE: list[tuple[str, str]] = [
    (r"^test_prioritized\.py::test_(ptdrb|prb)\[",
     "edits the caller's TensorDict after extend and expects samples to show it: TorchRL's "
     "ListStorage keeps references to the caller's data, a server stores copies"),
]
"""``(regular expression on the node id, why)``: tests of TorchRL's own internals."""


def reason_out_of_scope(parts: list[str]) -> str:
    """Why a test built from ``parts`` is out of scope ('' when it is in)."""
    for part in parts:
        if part in OUT_OF_SCOPE_PARTS:
            kind, _, name = part.partition("=")
            what = name if kind in ("storage", "sampler", "writer", "ensemble") else part
            return f"uses {what}: {OUT_OF_SCOPE_PARTS[part]}"
    return ""


def reason_not_applicable(nodeid: str, private: list[str] = ()) -> str:
    """Why the test at ``nodeid`` is not applicable ('' when it is): listed, or its code
    read ``private`` attributes of TorchRL's buffers, storages, samplers or writers."""
    if private:
        return f"reads TorchRL's private state: {', '.join(private[:3])}"
    for pattern, reason in NOT_APPLICABLE:
        if re.search(pattern, nodeid):
            return reason
    return ""
