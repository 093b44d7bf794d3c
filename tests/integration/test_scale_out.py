"""One logical replay over three real server processes (docs/scale-out.md).

The shards hold very different amounts of sampling mass (hundreds of times
apart), as real shards do after uneven placement or priorities. Exactness is
checked two ways: the merged sample's frequencies against the one-table
distribution (a chi-square test; seeds are fixed, so it is deterministic; the
tolerance is a p-value of 1e-4 on the statistic), and every reported
probability and weight against one in-process table holding all the rows.
Each exactness test runs twice: through ``sample`` (a round of unary calls)
and through ``stream`` (a SampleStream per shard, merged): shards 0 and 1
stream through shared memory, shard 2 (``shared_memory = false``) over gRPC.
The prioritized one runs a third time through a ``grouped`` stream (small
batches merged several per pass, as the learner's stream chooses by default).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from replay_client import ReplayClient
from replay_client.errors import (
    InvalidIdsError,
    ShardingError,
    UnavailableError,
    UnknownTableError,
    UnsupportedError,
)
from replay_client.sharded.client import ShardedClient
from replay_proto.batch import SampleBatch
from replay_server.engine.config import SamplerKind, TableConfig
from replay_server.engine.table import Table
from tests.conftest import ServerProcess, start_server, stays, wait_for

ALPHA, BETA, SLICE = 0.7, 0.5, 4
DRAWS = 150  # batches per exactness test
BATCH = 256


def shard_config(shard: int, auto: bool = False, shared_memory: bool = True) -> str:
    tables = [("p", "prioritized", ""), ("u", "uniform", ""),
              ("s", "slice", f"slice_len = {SLICE}"),
              ("ps", "prioritized_slice", f"slice_len = {SLICE}"), ("q", "fifo", "")]
    index = '"auto"' if auto else str(shard)
    text = f"[server]\nshard = {index}\nshared_memory = {str(shared_memory).lower()}\n"
    for name, sampler, extra in tables:
        text += (f"\n[[tables]]\nname = \"{name}\"\ncapacity = 2000\nsampler = \"{sampler}\"\n"
                 f"alpha = {ALPHA}\nbeta = {BETA}\nseed = {100 + shard}\n{extra}\n")
    return text


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> Iterator[list[ServerProcess]]:
    """Three shards (indices 0, 1, 2) with the same four tables; shard 2 as a StatefulSet pod
    finds its index (``shard = "auto"``, REPLAY_SHARD_INDEX from its pod-index label)."""
    tmp = tmp_path_factory.mktemp("shards")
    procs: list[ServerProcess] = []
    try:
        procs.append(start_server(tmp, shard_config(2, auto=True, shared_memory=False),
                                  name="shard2", env={"REPLAY_SHARD_INDEX": "2"}))
        for shard in (0, 1):  # not in index order: shards are known by index, not position
            procs.append(start_server(tmp, shard_config(shard), name=f"shard{shard}"))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def shards(trio) -> Iterator[dict[int, ReplayClient]]:
    """One-server clients by shard index, every table emptied first."""
    clients = {}
    for proc in trio:
        client = ReplayClient(proc.address)
        clients[client.server_info().shard] = client
        for table in ("p", "u", "s", "ps", "q"):
            client.reset(table)
    yield dict(sorted(clients.items()))
    for client in clients.values():
        client.close()


def sharded(trio, seed: int = 7) -> ShardedClient:
    client = ReplayClient([p.address for p in trio], seed=seed)
    assert isinstance(client, ShardedClient)
    return client


def drawn(client: ShardedClient, table: str, batch_size: int, via: str) -> list:
    """``DRAWS`` merged batches (clones), by unary samples or from one stream (``grouped``:
    small batches merged several per pass, the shards' chunks grouped per message)."""
    if via == "sample":
        return [client.sample(table, batch_size) for _ in range(DRAWS)]
    group = None if via == "grouped" else 1
    stream = client.stream(table, batch_size, num_batches=DRAWS, batches_per_message=group)
    out = [SampleBatch.from_columns({k: v.clone() for k, v in b.columns.items()},
                                    b.ids.clone(), b.weights.clone(), b.probabilities.clone())
           for b in stream]
    transports = "; ".join(stream.stats.notes)
    if via == "grouped":  # as the plain stream: 8 per pass, a window of (at least) two passes:
        # a learner that starves on a loaded machine widens it further by itself (replay_feed.window)
        assert "8 merged batches per pass" in transports and stream.window >= 16, transports
        return out
    assert transports.count("shared memory:") == 2, transports  # shards 0 and 1
    assert "shared_memory = false" in transports  # shard 2's note: gRPC
    return out


VIA = pytest.mark.parametrize("via", ["sample", "stream"])


def chi_square_ok(observed: Counter, expected: dict, draws: int) -> tuple[bool, float, float]:
    """Pearson's statistic over the keys of ``expected`` (probabilities), and its 1e-4 critical
    value (Wilson-Hilferty), so a correct sampler fails once in 10,000 seeds."""
    stat = sum((observed.get(k, 0) - draws * p) ** 2 / (draws * p) for k, p in expected.items())
    dof = len(expected) - 1
    z = 3.719  # standard normal quantile of 1 - 1e-4
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert sum(observed.values()) == draws and set(observed) <= set(expected)
    return stat <= critical, stat, critical


def one_table(sampler: SamplerKind, rows: dict[str, torch.Tensor],
              priorities: torch.Tensor | None) -> Table:
    """An in-process table holding every row of every shard (the reference)."""
    table = Table(TableConfig(name="all", capacity=2000, sampler=sampler, alpha=ALPHA, beta=BETA,
                              slice_len=SLICE if sampler.traits.slices else None, seed=1))
    table.insert(rows, priorities)
    return table


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("via", ["sample", "stream", "grouped"])
def test_prioritized_merge_is_one_tables_distribution_and_weights(trio, shards, via) -> None:
    # Shard masses about 0.6 : 20 : 430 (p^alpha summed): hundreds of times apart.
    layout = {0: (5, 0.05), 1: (20, 1.0), 2: (40, 30.0)}
    keys, prios = [], []
    for shard, (rows, priority) in layout.items():
        key = torch.arange(rows, dtype=torch.int64) + 1000 * shard
        shards[shard].insert("p", {"key": key}, priorities=torch.full((rows,), priority))
        keys.append(key)
        prios.append(torch.full((rows,), priority, dtype=torch.float64))
    all_keys, all_prios = torch.cat(keys), torch.cat(prios)
    reference = one_table(SamplerKind.PRIORITIZED, {"key": all_keys}, all_prios)
    ref = reference.sample(20_000)
    ref_p = dict(zip(ref.columns["key"].tolist(), ref.probabilities.tolist()))
    ref_w = dict(zip(ref.columns["key"].tolist(), ref.weights.tolist()))
    assert len(ref_p) == len(all_keys)  # every row was drawn, so each has its reference value

    with sharded(trio) as client:
        counts: Counter = Counter()
        per_shard: Counter = Counter()
        for batch in drawn(client, "p", BATCH, via):
            got = batch.columns["key"].tolist()
            counts.update(got)
            per_shard.update((batch.ids >> 56).tolist())
            np.testing.assert_allclose(batch.probabilities.numpy(), [ref_p[k] for k in got],
                                       rtol=1e-6)
            np.testing.assert_allclose(batch.weights.numpy(), [ref_w[k] for k in got], rtol=1e-5)
            assert ((batch.ids >> 56) == batch.columns["key"] // 1000).all()  # id names its shard
    ok, stat, critical = chi_square_ok(counts, ref_p, DRAWS * BATCH)
    assert ok, (stat, critical)
    assert set(per_shard) == {0, 1, 2}


@pytest.mark.parametrize("via", ["sample", "stream", "grouped"])
def test_uniform_merge_draws_every_row_of_the_union_alike(trio, shards, via) -> None:
    sizes = {0: 3, 1: 30, 2: 300}
    for shard, rows in sizes.items():
        shards[shard].insert("u", {"key": torch.arange(rows, dtype=torch.int64) + 1000 * shard})
    total = sum(sizes.values())
    with sharded(trio) as client:
        counts: Counter = Counter()
        for batch in drawn(client, "u", BATCH, via):
            counts.update(batch.columns["key"].tolist())
            np.testing.assert_allclose(batch.probabilities.numpy(), 1 / total, rtol=1e-12)
            assert (batch.weights == 1).all()
    expected = {k + 1000 * s: 1 / total for s, n in sizes.items() for k in range(n)}
    ok, stat, critical = chi_square_ok(counts, expected, DRAWS * BATCH)
    assert ok, (stat, critical)


@pytest.mark.parametrize("via", ["sample", "stream", "grouped"])
@pytest.mark.parametrize("table", ["s", "ps"])
def test_slice_merge_draws_slice_starts_as_one_table(trio, shards, table: str, via) -> None:
    # Episodes per shard: (count, length, priority): 3, 21 and 170 slice starts.
    layout = {0: (1, 6, 0.2), 1: (3, 10, 1.0), 2: (10, 20, 5.0)}
    columns: dict[str, list[torch.Tensor]] = {"episode": [], "step": []}
    prios = []
    for shard, (episodes, length, priority) in layout.items():
        episode = torch.arange(episodes, dtype=torch.int64).repeat_interleave(length) + 100 * shard
        step = torch.arange(length, dtype=torch.int64).repeat(episodes)
        priority_of = torch.full((episodes * length,), priority, dtype=torch.float64)
        data = {"episode": episode, "step": step}
        shards[shard].insert(table, data, priorities=priority_of if table == "ps" else None)
        columns["episode"].append(episode)
        columns["step"].append(step)
        prios.append(priority_of)
    kind = SamplerKind.SLICE if table == "s" else SamplerKind.PRIORITIZED_SLICE
    rows = {k: torch.cat(v) for k, v in columns.items()}
    reference = one_table(kind, rows, torch.cat(prios) if table == "ps" else None)
    ref = reference.sample(20_000)
    start = list(zip(ref.columns["episode"][:, 0].tolist(), ref.columns["step"][:, 0].tolist()))
    ref_p, ref_w = dict(zip(start, ref.probabilities.tolist())), dict(zip(start, ref.weights.tolist()))
    assert len(ref_p) == 3 + 21 + 170

    with sharded(trio) as client:
        counts: Counter = Counter()
        for batch in drawn(client, table, 64, via):
            episode, step = batch.columns["episode"], batch.columns["step"]
            assert (episode == episode[:, :1]).all()  # one episode per slice...
            assert (step == step[:, :1] + torch.arange(SLICE)).all()  # ...its steps in order
            got = list(zip(episode[:, 0].tolist(), step[:, 0].tolist()))
            counts.update(got)
            np.testing.assert_allclose(batch.probabilities.numpy(), [ref_p[k] for k in got],
                                       rtol=1e-6)
            np.testing.assert_allclose(batch.weights.numpy(), [ref_w[k] for k in got], rtol=1e-5)
    ok, stat, critical = chi_square_ok(counts, ref_p, DRAWS * 64)
    assert ok, (stat, critical)


# ------------------------------------------------------------------- updates


def test_updates_reach_the_owning_shard_and_stale_ids_stay_ignored(trio, shards) -> None:
    with sharded(trio) as client:
        ids = torch.cat([client.insert("p", {"key": torch.arange(10, dtype=torch.int64)})
                         for _ in range(6)])
        owners = Counter((ids >> 56).tolist())
        assert owners == {0: 20, 1: 20, 2: 20}  # round-robin: six inserts, two per shard
        before = {s: c.info()["p"].counters for s, c in shards.items()}
        assert client.update_priorities("p", ids, torch.full((60,), 2.0)) == 60
        after = {s: c.info()["p"].counters for s, c in shards.items()}
        for shard in shards:
            assert after[shard]["priority_updates"] - before[shard]["priority_updates"] == 20

        shards[1].reset("p")  # shard 1's ids are stale now; the others' are not
        assert client.update_priorities("p", ids, torch.full((60,), 3.0)) == 40
        stale = {s: c.info()["p"].counters["stale_priority_updates"] for s, c in shards.items()}
        assert stale[1] - after[1]["stale_priority_updates"] == 20
        assert stale[0] == after[0]["stale_priority_updates"]

        foreign = torch.tensor([int(ids[0]), 5 << 56], dtype=torch.int64)
        with pytest.raises(InvalidIdsError, match="belongs to shard 5"):
            client.update_priorities("p", foreign, torch.ones(2))
        assert shards[0].info()["p"].counters["priority_updates"] == (
            after[0]["priority_updates"] + 20)  # the refused update applied nothing


def test_info_sums_the_shards_and_shard_info_names_each(trio, shards) -> None:
    for shard, client in shards.items():
        client.insert("u", {"key": torch.arange(shard + 1, dtype=torch.int64)})
    with sharded(trio) as client:
        assert client.info()["u"].size == 1 + 2 + 3
        assert client.info()["u"].capacity == 3 * 2000
        per_shard = client.shard_info()
        assert sorted(per_shard) == [0, 1, 2]
        assert [per_shard[s].tables["u"].size for s in (0, 1, 2)] == [1, 2, 3]
        with pytest.raises(UnknownTableError, match="no table named 'nope'"):
            client.sample("nope", 4)


# ----------------------------------------------------------- discovery


def test_a_name_resolving_to_every_shard_finds_them_by_their_index(trio, shards) -> None:
    asked = []

    def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return [p.address for p in trio]

    client = ReplayClient("shards://replay-headless.replay.svc.cluster.local:50051",
                          resolver=resolver)
    with client:
        assert client.shards == {s: shards[s].address for s in (0, 1, 2)}
    assert asked == [("replay-headless.replay.svc.cluster.local", 50051)]


def test_two_servers_reporting_one_shard_index_or_differing_tables_are_refused(
        trio, tmp_path) -> None:
    twin = start_server(tmp_path, shard_config(1).replace(f"alpha = {ALPHA}", "alpha = 0.9", 1),
                        name="twin")  # shard 1 again, and its table "p" has another alpha
    try:
        with pytest.raises(ShardingError, match="both report shard 1") as raised:
            ReplayClient([p.address for p in trio] + [twin.address]).info()
        assert twin.address in str(raised.value)
        shard_2, shard_0 = trio[0], trio[1]  # the fixture started shards 2, 0, 1
        with ReplayClient([shard_2.address, shard_0.address, twin.address]) as client:
            with pytest.raises(ShardingError, match="table 'p' differs between shards"):
                client.sample("p", 4)
    finally:
        twin.stop()


# ------------------------------------------------------------------ placement


def test_writers_keep_each_episode_whole_on_one_shard(trio, shards) -> None:
    """Four actors interleave steps; writes are cut every 3 rows, across episodes of 4."""
    episodes_each = 6
    before = {s: c.info()["s"].counters["inserted"] for s, c in shards.items()}
    with sharded(trio) as client:
        writers = [client.writer("s", batch_rows=3, max_delay_s=0.01) for _ in range(4)]
        for _ in range(episodes_each):
            for t in range(SLICE):
                for w in writers:
                    w.append({"step": torch.tensor(t, dtype=torch.int64)})
            for w in writers:
                w.end_episode()
        for w in writers:
            w.close()
        per_shard = {s: c.info()["s"] for s, c in shards.items()}
        slices = {s: info.mass.count for s, info in per_shard.items()}
        # An episode of exactly SLICE steps is one slice start only if all its steps are on one
        # shard; a cut one would be none anywhere.
        assert sum(slices.values()) == 4 * episodes_each
        for shard, info in per_shard.items():
            assert info.counters["inserted"] - before[shard] == SLICE * slices[shard]
        assert sum(1 for n in slices.values() if n) >= 2  # episodes were spread over shards
        batch = client.sample("s", 64)
        assert (batch.columns["step"] == torch.arange(SLICE)).all()
        assert (batch.columns["episode"] == batch.columns["episode"][:, :1]).all()


def test_an_insert_of_many_episodes_splits_by_episode_and_returns_ids_in_row_order(
        trio, shards) -> None:
    episode = torch.arange(12, dtype=torch.int64).repeat(5)  # 12 episodes, rows interleaved
    step = torch.arange(5, dtype=torch.int64).repeat_interleave(12)
    with sharded(trio) as client:
        ids = client.insert("ps", {"episode": episode, "step": step},
                            priorities=(episode + 1).double())
        home = {}
        for e, shard in zip(episode.tolist(), (ids >> 56).tolist()):
            assert home.setdefault(e, shard) == shard  # one shard per episode
        assert len(set(home.values())) >= 2
        for e in range(12):  # each episode's rows kept their order on their shard
            assert (ids[episode == e].diff() > 0).all()
        assert sum(c.info()["ps"].size for c in shards.values()) == 60
        batch = client.sample("ps", 64)
        start = batch.columns["episode"][:, 0]
        total = sum(2 * (e + 1.0) ** ALPHA for e in range(12))  # two slice starts per episode
        torch.testing.assert_close(  # the priorities went with their rows
            batch.probabilities, ((start + 1.0) ** ALPHA).double() / total, rtol=1e-5, atol=0)


# -------------------------------------------------------------------- streams


def test_a_stream_over_shards_stays_within_its_windows_and_groups_small_rows(trio, shards) -> None:
    for shard, (rows, priority) in {0: (10, 0.5), 1: (10, 2.0), 2: (10, 8.0)}.items():
        shards[shard].insert("p", {"key": torch.arange(rows, dtype=torch.int64) + 1000 * shard},
                             priorities=torch.full((rows,), priority))

    def sampled() -> dict[int, int]:
        return {s: c.info()["p"].counters["sampled"] for s, c in shards.items()}

    before = sampled()
    with sharded(trio) as client:
        stream = client.stream("p", 32, prefetch=3, batches_per_message=1)
        batches = [next(stream).ids.clone() for _ in range(2)]
        notes = "; ".join(stream.stats.notes)
        chunk, window = 11, 15  # 32 rows over 3 shards; (3 + 2) * 32 / 11 chunks in flight
        assert f"chunks of {chunk} rows (window {window} chunks" in notes, notes
        # Each shard runs at most its window of chunks ahead of what the merge took: the learner
        # holds 2 merged batches (+ 3 ahead), so the shards drew at most that plus their windows.
        last: list[dict[int, int]] = [{}]

        def unchanged() -> bool:  # two polls 0.2 s apart agree: every window is full
            now, previous = sampled(), last[0]
            last[0] = now
            return now == previous and all(now[s] > before[s] for s in shards)

        assert wait_for(unchanged, interval=0.2)
        settled = last[0]
        assert stays(lambda: sampled() == settled, seconds=0.5)  # the windows hold: no more
        taken_rows = (2 + 3) * 32
        assert sum(settled[s] - before[s] for s in shards) <= taken_rows + 3 * window * chunk
        batches += [b.ids.clone() for _, b in zip(range(6), stream)]
        stream.close()
    ids = torch.cat(batches)
    assert set((ids >> 56).tolist()) == {0, 1, 2}

    # Small rows are grouped on each shard's stream (as on one server): few messages per chunk.
    with sharded(trio) as client:
        grouped = client.stream("p", 32, num_batches=8)
        assert [len(b.ids) for b in grouped] == [32] * 8
    # A shard's chunks (11 rows: a third of a batch) go up to 23 a message: the rows of
    # one server's message of 8 batches, so three shards cost no more messages than one.
    assert "batches_per_message=23 chosen" in "; ".join(grouped.stats.notes)


def test_the_updates_of_a_bounded_sharded_streams_last_batches_reach_their_shards(
        trio, shards) -> None:
    """A merged stream of ``num_batches`` stopped routing the learner's updates to the shards
    with its last batch, a window before the learner took it: those updates were dropped
    (160 of 192 applied here). Now they are routed until the learner closes."""
    for shard in shards:
        shards[shard].insert("p", {"key": torch.arange(20, dtype=torch.int64)})

    def applied() -> int:
        return sum(c.info()["p"].counters["priority_updates"] for c in shards.values())

    before = applied()
    with sharded(trio) as client:
        with client.stream("p", 16, num_batches=12, prefetch=4, batches_per_message=1) as stream:
            for batch in stream:
                stream.update_priorities(batch.ids, torch.full((16,), 2.0))
    assert wait_for(lambda: applied() - before == 12 * 16), applied() - before
    assert stays(lambda: applied() - before == 12 * 16, seconds=0.3)


# --------------------------------------------------------------------- faults


def test_a_killed_shard_fails_calls_by_default_or_is_left_out_when_allowed_and_rejoins(
        tmp_path) -> None:
    """Shard 1 is killed while a degraded-mode client samples; a default client fails naming it;
    restarted on its port, it rejoins."""
    procs = {s: start_server(tmp_path, shard_config(s), name=f"f{s}") for s in (0, 1, 2)}
    try:
        addresses = [procs[s].address for s in (0, 1, 2)]
        for shard, priority in {0: 1.0, 1: 4.0, 2: 9.0}.items():
            with ReplayClient(procs[shard].address) as one:  # p^0.7 masses per row: 1, 2.6, 4.7
                one.insert("p", {"key": torch.arange(10, dtype=torch.int64) + 1000 * shard},
                           priorities=torch.full((10,), priority))
        strict = ReplayClient(addresses, timeout=5.0, max_retry_s=0.3)
        lenient = ReplayClient(addresses, timeout=5.0, allow_degraded=True, seed=1)
        assert strict.sample("p", 64).batch_size == lenient.sample("p", 64).batch_size == 64
        ids = strict.sample("p", 256).ids

        batches, errors, stop = [], [], threading.Event()

        def load() -> None:  # the learner: samples without pause while shard 1 dies
            while not stop.is_set():
                try:
                    batches.append(lenient.sample("p", 64))
                except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                    errors.append(exc)
                    return

        thread = threading.Thread(target=load)
        thread.start()
        assert wait_for(lambda: len(batches) >= 5)
        procs[1].process.kill()
        procs[1].process.wait()
        assert wait_for(lambda: batches and batches[-1].missing_shards == (1,), timeout=30)
        seen = len(batches)
        assert wait_for(lambda: len(batches) >= seen + 20)
        stop.set()
        thread.join()
        assert not errors, errors

        # Degraded: the live shards' rows only, with probabilities over their mass alone.
        late = batches[-1]
        assert set((late.ids >> 56).tolist()) <= {0, 2}
        live_mass = 10 * (1.0 ** 0.7) + 10 * (9.0 ** 0.7)
        expected = torch.where(late.ids >> 56 == 0, 1.0, 9.0 ** 0.7).double() / live_mass
        torch.testing.assert_close(late.probabilities, expected, rtol=1e-6, atol=0)
        stats = lenient.shard_stats()
        assert 1 in stats.down and stats.degraded_samples > 0
        new = torch.cat([lenient.insert("p", {"key": torch.full((4,), -1)}) for _ in range(6)])
        assert set((new >> 56).tolist()) == {0, 2}  # inserts go to the live shards
        assert lenient.update_priorities("p", ids, torch.ones(len(ids))) == int(
            ((ids >> 56) != 1).sum())  # shard 1's ids are skipped, the rest applied

        # Default: every call that needs shard 1 fails, naming it.
        for call in (lambda: strict.sample("p", 64),
                     lambda: strict.update_priorities("p", ids, torch.ones(len(ids))),
                     lambda: strict.info()):
            with pytest.raises(UnavailableError, match=r"shard 1 \(127\.0\.0\.1:"):
                call()

        # Back on its port (empty: it had no checkpoint), shard 1 rejoins both clients.
        procs[1] = start_server(tmp_path, shard_config(1), name="f1-again", port=procs[1].port)
        assert wait_for(lambda: lenient.sample("p", 8).missing_shards == (), timeout=30)
        assert 1 not in lenient.shard_stats().down
        assert lenient.shard_stats().rejoins >= 1
        back = torch.cat([lenient.insert("p", {"key": torch.full((4,), -2)}) for _ in range(6)])
        assert 1 in set((back >> 56).tolist())
        assert strict.info()["p"].size == lenient.info()["p"].size
        strict.close()
        lenient.close()
    finally:
        for proc in procs.values():
            proc.stop()


def test_deletes_go_to_each_ids_shard_and_queues_are_not_sampled_over_shards(trio, shards):
    client = sharded(trio)
    ids = torch.cat([client.insert("q", {"x": torch.full((10,), float(k))}) for k in range(3)])
    owners = (ids >> 56).tolist()
    assert sorted(set(owners)) == [0, 1, 2]  # whole inserts, one shard each in turn
    with pytest.raises(InvalidIdsError, match="nothing was deleted"):
        client.delete("q", torch.cat([ids[:2], torch.tensor([5 << 56])]))
    assert sum(c.info()["q"].size for c in shards.values()) == 30  # the refusal deleted nothing
    assert client.delete("q", ids[::2]) == 15
    for shard, one in shards.items():
        assert one.info()["q"].size == 10 - sum(o == shard for o in owners[::2])
    with pytest.raises(UnsupportedError, match="queue"):
        client.sample("q", 4)
    with pytest.raises(UnsupportedError, match="no lease to acknowledge"):
        client.ack("q")
    assert client.info()["q"].size == 15  # nothing was taken
    client.close()


# --------------------------------------------------------- following the cluster


def test_a_fourth_server_under_the_name_joins_without_a_client_restart(trio, shards,
                                                                       tmp_path) -> None:
    """A StatefulSet scaled from 3 to 4: the name resolves to one more address; the client,
    resolving again on its interval, inserts into and samples from the new shard, and a
    stream opened before the scale-up takes it in too."""
    names = [p.address for p in trio]

    def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("replay-server.replay.svc", 50051)
        return list(names)

    fourth = start_server(tmp_path, shard_config(3), name="shard3")
    try:
        with ReplayClient("shards://replay-server.replay.svc:50051", resolver=resolver,
                          resolve_interval_s=0.2, seed=5) as client:
            for _ in range(6):
                client.insert("u", {"key": torch.arange(10, dtype=torch.int64)})
            assert sorted(client.shards) == [0, 1, 2]
            stream = client.stream("u", 16, batches_per_message=1)
            next(stream)
            names.append(fourth.address)  # the fourth pod is ready: the name gives it
            assert wait_for(lambda: sorted(client.shards) == [0, 1, 2, 3], timeout=10)
            ids = torch.cat([client.insert("u", {"key": torch.arange(10, dtype=torch.int64)})
                             for _ in range(8)])
            assert 3 in set((ids >> 56).tolist())  # inserts reach it...
            assert wait_for(lambda: 3 in set((client.sample("u", 64).ids >> 56).tolist()))
            assert wait_for(lambda: 3 in set((next(stream).ids >> 56).tolist()))  # ...the stream too
            stream.close()
    finally:
        fourth.stop()


def test_a_degraded_client_starts_with_a_server_down_and_takes_it_when_it_comes(
        trio, shards, tmp_path) -> None:
    import socket

    with socket.socket() as sock:  # a port no one listens on yet
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    addresses = [p.address for p in trio] + [f"127.0.0.1:{port}"]
    with pytest.raises(UnavailableError, match=f"127.0.0.1:{port}"):
        ReplayClient(addresses, max_retry_s=0.3).info()  # strict: every server must answer
    client = ReplayClient(addresses, allow_degraded=True, resolve_interval_s=0.2)
    try:
        client.insert("u", {"key": torch.arange(4, dtype=torch.int64)})
        assert sorted(client.shards) == [0, 1, 2]
        late = start_server(tmp_path, shard_config(3), name="late", port=port)
        try:
            assert wait_for(lambda: sorted(client.shards) == [0, 1, 2, 3], timeout=20)
            ids = torch.cat([client.insert("u", {"key": torch.arange(4, dtype=torch.int64)})
                             for _ in range(8)])
            assert 3 in set((ids >> 56).tolist())
        finally:
            late.stop()
    finally:
        client.close()


def test_a_shard_the_name_no_longer_gives_is_down(trio, shards) -> None:
    names = [p.address for p in trio]
    client = ReplayClient("shards://replay:50051", resolver=lambda h, p: list(names),
                          allow_degraded=True, resolve_interval_s=0.2)
    try:
        client.insert("u", {"key": torch.arange(4, dtype=torch.int64)})
        gone = next(s for s, a in client.shards.items() if a == names[-1])
        names.pop()  # scaled down: that pod is gone from the name
        assert wait_for(lambda: client.info() and gone in client.shard_stats().down, timeout=10)
        ids = torch.cat([client.insert("u", {"key": torch.arange(4, dtype=torch.int64)})
                         for _ in range(6)])
        assert gone not in set((ids >> 56).tolist())  # down: left out, though it would answer
        names.append(trio[-1].address)  # scaled up again
        assert wait_for(lambda: client.info() and gone not in client.shard_stats().down,
                        timeout=10)
    finally:
        client.close()
