"""replay_feed: the learner's runtime, shared by the network client and the embedded server.

A *feed* produces batches on a background thread into a reused ring of
staging buffers (pinned when an accelerator is present), applies the
learner's transform, pins what it returned and starts the device copy on a
side stream (:mod:`~replay_feed.core`, :mod:`~replay_feed.stream`). The
accelerator sits behind a small interface (:mod:`~replay_feed.accelerator`)
so tests without a GPU can substitute a simulated one; same-host learners
read batches from a shared-memory ring (:mod:`~replay_feed.shared_ring`).

Imports the wire package (``replay_proto``) for the batch container; the wire
package never imports this one, and neither ``replay_server`` nor
``replay_client`` is imported here.
"""

from replay_feed.accelerator import Accelerator, CudaAccelerator, detect_accelerator
from replay_feed.core import FeedCore, FeedStats, Layout, Source
from replay_feed.delivery import Delivery, resolve_delivery
from replay_feed.pipeline import DeliveryStage, HostCopier, default_threads
from replay_feed.shared_ring import SharedMemoryError, SharedRing, host_id
from replay_feed.stream import BatchStream
from replay_feed.tree import tree_leaves

__all__ = [
    "Accelerator",
    "BatchStream",
    "CudaAccelerator",
    "Delivery",
    "DeliveryStage",
    "FeedCore",
    "FeedStats",
    "HostCopier",
    "Layout",
    "SharedMemoryError",
    "SharedRing",
    "Source",
    "default_threads",
    "detect_accelerator",
    "host_id",
    "resolve_delivery",
    "tree_leaves",
]
