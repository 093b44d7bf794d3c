"""replay_client.sharded: one logical replay over many servers, a layer over one-server clients.

:class:`~replay_client.sharded.client.ShardedClient` implements
:class:`~replay_client.api.ReplayApi` over shards: placement of inserts
(:mod:`.placement`), exact merged sampling (:mod:`.split`, :mod:`.merge`), ids
routed to their shard (:mod:`.routing`), discovery (:mod:`.discovery`),
degraded mode (:mod:`.health`), the merged learner stream (:mod:`.stream`).
Nothing outside this package imports it but the front door,
:mod:`replay_client.client` (``tests/test_layout.py``).
"""
