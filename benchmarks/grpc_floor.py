"""Python gRPC's own floor beside our per-call paths and Reverb's, in one run.

    python benchmarks/grpc_floor.py --reverb-python <reverb venv>/bin/python --rounds 3

The rows where Reverb is ahead (docs/benchmarks.md) are single calls through
Python gRPC: a priority update of 128 ids that waits for its answer, a unary
sample of 256 Atari rows. This measures what those calls cost with no replay
work at all, on the same machine in the same run: a bare ``grpc.aio`` server
(uvloop, our server's transport options) in its own process that

- echoes a message the size of an encoded 128-id update on one bidirectional
  stream, read by a sync client the way ``UpdateStream`` reads it (a request
  iterator, one answer at a time): the floor of a waiting update;
- answers a unary call with a 7.2 MB message (the size of 256 Atari rows, as
  our ``Sample`` answers them): the floor of a unary sample.

Each round runs the floor, ours (``replay-server serve``, the same tables as
``benchmarks/service.py``) and Reverb (``benchmarks/reverb_service.py``)
one after another. Prints three tables (medians over the rounds):

1. each side's time per call, and what 1.5x Reverb would need against the floor;
2. a small unary call by how the bare server serves it (:data:`SHAPES`: wall and
   server CPU per call), beside our ``Acknowledge`` with nothing to do;
3. 256 Atari rows from a same-host stream one batch ahead, each copied out of
   the shared-memory ring: what the bytes cost once they leave gRPC.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402
from service import _CONFIG, _reverb, _rows_as_torch  # noqa: E402
from sides import replay_server  # noqa: E402

SERVICE = "floor.Echo"
SMALL_ANSWER = b"\x07" * 64
SHAPES = {
    "unary_unary": "unary handler (gRPC reads the request before the handler runs)",
    "stream_unary": "client-streaming handler: context.read(), then return the answer",
    "stream_stream": "bidirectional handler: context.read(), context.write() (how "
                     "replay-server serves its unary methods)",
}
"""How a server may serve one small unary call (the client makes a plain unary call to each)."""
IDS = 128
"""Ids per waiting priority update (the row where Reverb is ahead)."""


def _identity(raw: bytes) -> bytes:
    return raw


def _echo_server(port_out: multiprocessing.Queue, answer_bytes: int) -> None:
    """A bare grpc.aio server: Echo (bidirectional, each message back) and Answer (unary,
    ``answer_bytes`` back), with the transport options ``replay-server`` uses."""
    import grpc
    import uvloop

    answer = b"\x07" * answer_bytes

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.http2.bdp_probe", 0)])

        async def echo(_requests: object, context: grpc.aio.ServicerContext) -> None:
            while (message := await context.read()) is not grpc.aio.EOF:
                await context.write(message)

        async def unary(_request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
            return answer

        # A small call's three serving shapes (SHAPES): each answers 64 bytes.
        async def small(_request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
            return SMALL_ANSWER

        async def read_return(_requests: object, context: grpc.aio.ServicerContext) -> bytes:
            await context.read()
            return SMALL_ANSWER

        async def read_write(_requests: object, context: grpc.aio.ServicerContext) -> None:
            await context.read()
            await context.write(SMALL_ANSWER)

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": grpc.stream_stream_rpc_method_handler(echo, _identity, _identity),
            "Answer": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "unary_unary": grpc.unary_unary_rpc_method_handler(small, _identity, _identity),
            "stream_unary": grpc.stream_unary_rpc_method_handler(read_return, _identity,
                                                                 _identity),
            "stream_stream": grpc.stream_stream_rpc_method_handler(read_write, _identity,
                                                                   _identity),
        }),))
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


def _floor(seconds: float, update_bytes: int, answer_bytes: int) -> dict:
    import grpc

    ports: multiprocessing.Queue = multiprocessing.Queue()
    process = multiprocessing.Process(target=_echo_server, args=(ports, answer_bytes),
                                      daemon=True)
    process.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        with grpc.insecure_channel(address, options=[
                ("grpc.max_receive_message_length", 64 << 20)]) as channel:
            outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

            def requests() -> Iterator[bytes]:
                while (message := outgoing.get()) is not None:
                    yield message

            answers = channel.stream_stream(f"/{SERVICE}/Echo")(requests())
            message = b"\x01" * update_bytes

            def round_trip() -> None:
                outgoing.put(message)
                next(answers)

            trip = _per_call(round_trip, seconds)
            outgoing.put(None)
            unary = channel.unary_unary(f"/{SERVICE}/Answer")
            answer = _per_call(lambda: unary(b""), seconds)
            server = psutil.Process(process.pid)
            shapes = {shape: _timed_with_server_cpu(
                server, channel.unary_unary(f"/{SERVICE}/{shape}"), b"\x01" * 40, seconds)
                for shape in SHAPES}
    finally:
        process.terminate()
        process.join(10)
    return {"update_s": trip, "sample_s": answer, "shapes": shapes}


def _ours(seconds: float) -> dict:
    import grpc
    import torch

    from replay_client import ReplayClient
    from replay_proto.v1 import replay_pb2 as pb

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, replay_server(Path(tmp), _CONFIG) as address:
        # REPLAY_SHARED_MEMORY=0: the unary sample and the waiting update through gRPC, as
        # from another host (on this host they go through the sample stream's
        # shared-memory region and the update stream's local socket since 2026-11-29:
        # benchmarks/service.py's "sample (batch 256)" and "update_priorities" rows).
        # The client's call streams read it when first used; the learner's stream below
        # (a shared-memory ring) when it opens, after it is gone again.
        os.environ["REPLAY_SHARED_MEMORY"] = "0"
        try:
            client = ReplayClient(address, timeout=120)
            for kind, rows in (("small", 200_000), ("atari", 20_000)):
                chunk = 1_000 if kind == "atari" else 20_000
                for first in range(0, rows, chunk):
                    client.insert(kind, _rows_as_torch(w.make_rows(kind, first, chunk)))
            ids = client.sample("small", IDS).ids
            client.update_priorities("small", ids, torch.ones(IDS))  # its update stream too
        finally:
            del os.environ["REPLAY_SHARED_MEMORY"]
        priorities = [torch.from_numpy(w.new_priorities(IDS, i)) for i in range(64)]
        turn = iter(range(1 << 62))
        update = _per_call(lambda: client.update_priorities(
            "small", ids, priorities[next(turn) % 64], wait=True), seconds)
        sample = _per_call(lambda: client.sample("atari", w.SAMPLE_BATCH), seconds)
        ring = _ring_batches(client, seconds)
        # A call with nothing to do: all of a small call's plumbing, no engine work.
        server = next(p for p in psutil.Process().children()
                      if "replay_server.app.cli" in p.cmdline())
        with grpc.insecure_channel(address) as channel:
            empty = _timed_with_server_cpu(
                server, channel.unary_unary("/replay.v1.ReplayService/Acknowledge"),
                pb.AcknowledgeRequest(table="small").SerializeToString(), seconds)
    return {"update_s": update, "sample_s": sample, "ring_sample_s": ring, "empty_call": empty}


def _ring_batches(client: Any, seconds: float) -> float:
    """Seconds per batch of 256 Atari rows from a same-host stream one batch ahead, each
    batch copied out of the shared-memory ring as a unary answer's would be owned: what the
    bytes cost once they leave gRPC (the draw overlaps the copy: a bound, not a unary call)."""
    taken, start = 0, 0.0
    for batch in client.stream("atari", w.SAMPLE_BATCH, shared_memory=True, prefetch=1,
                               batches_per_message=1):
        _owned = {key: tensor.clone() for key, tensor in batch.data.items()}  # the caller's
        taken += 1
        if taken == 20:  # warmed up
            start = time.perf_counter()
        elif taken > 20 and time.perf_counter() - start >= seconds:
            break
    return (time.perf_counter() - start) / (taken - 20)


def _theirs(python: str, seconds: float) -> dict | None:
    update = _reverb(python, "small", "update", seconds, IDS)
    sample = _reverb(python, "atari", "sample", seconds)
    if update is None or sample is None:
        return None
    return {"update_s": IDS / update["ids_per_s"],
            "sample_s": w.SAMPLE_BATCH / sample["rows_per_s"]}


def _per_call(call: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``call()`` back to back for ``seconds`` (after a warm-up)."""
    return seconds / _calls_in(call, seconds)


def _calls_in(call: Callable[[], object], seconds: float) -> float:
    """Calls of ``call()`` per ``seconds``, back to back (after a warm-up), scaled to exactly
    ``seconds`` of wall time."""
    for _ in range(20):
        call()
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        call()
        done += 1
    return done * seconds / elapsed


def _timed_with_server_cpu(server: psutil.Process, call: Callable[[bytes], object],
                           request: bytes, seconds: float) -> dict:
    """Wall time and ``server``'s CPU time per ``call(request)``, back to back for ``seconds``."""
    before = server.cpu_times()
    calls = _calls_in(lambda: call(request), seconds)
    after = server.cpu_times()
    used = after.user + after.system - before.user - before.system
    return {"wall_s": seconds / calls, "server_cpu_s": used / calls}


def _sizes() -> tuple[int, int]:
    """Bytes of an encoded 128-id update and of a 256-row Atari sample's answer (payload)."""
    update = IDS * (8 + 4) + 32  # ids int64, priorities float32, the message's fields
    return update, w.SAMPLE_BATCH * w.row_bytes("atari") + 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", help="python of Reverb's virtualenv")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rounds here")
    args = parser.parse_args()

    update_bytes, answer_bytes = _sizes()
    rounds = []
    for round_ in range(args.rounds):
        print(f"round {round_ + 1} of {args.rounds}", file=sys.stderr)
        row = {"floor": _floor(args.seconds, update_bytes, answer_bytes),
               "ours": _ours(args.seconds),
               "reverb": _theirs(args.reverb_python, args.seconds) if args.reverb_python
               else None}
        print(f"  {row}", file=sys.stderr)
        rounds.append(row)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))
    print(_table(rounds, update_bytes, answer_bytes))
    print()
    print(_shapes_table(rounds))
    print()
    print(_ring_table(rounds))


def _table(rounds: list[dict], update_bytes: int, answer_bytes: int) -> str:
    def median(side: str, key: str) -> float | None:
        values = [r[side][key] for r in rounds if r[side] is not None]
        return statistics.median(values) if values else None

    lines = ["| call | Python gRPC floor | replay-server | Reverb 0.14.0 | ours / floor | "
             "1.5x Reverb needs |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, what in (("update_s", f"priority update of {IDS} ids, waiting "
                                   f"(floor: {update_bytes:,} B echoed on a stream)"),
                      ("sample_s", f"unary sample of {w.SAMPLE_BATCH} Atari rows "
                                   f"(floor: a {answer_bytes / 1e6:.1f} MB unary answer)")):
        floor, ours, reverb = (median(side, key) for side in ("floor", "ours", "reverb"))
        assert floor is not None and ours is not None
        need = f"{reverb / 1.5 * 1e3:.3f} ms ({reverb / 1.5 / floor:.2f}x the floor)" \
            if reverb is not None else "-"
        lines.append(f"| {what} | {floor * 1e3:.3f} ms | {ours * 1e3:.3f} ms | "
                     f"{'-' if reverb is None else f'{reverb * 1e3:.3f} ms'} | "
                     f"{ours / floor:.2f}x | {need} |")
    return "\n".join(lines)


def _ring_table(rounds: list[dict]) -> str:
    ours = statistics.median(r["ours"]["sample_s"] for r in rounds)
    ring = statistics.median(r["ours"]["ring_sample_s"] for r in rounds)
    reverb = [r["reverb"]["sample_s"] for r in rounds if r["reverb"] is not None]
    against = (f" | {statistics.median(reverb) / ring:.2f}x" if reverb else " | -")
    return ("| 256 Atari rows, same host | per batch | against our unary sample "
            "| against Reverb's |\n|---|---:|---:|---:|\n"
            f"| stream one batch ahead over the shared-memory ring, each batch copied out | "
            f"{ring * 1e3:.3f} ms | {ours / ring:.2f}x{against} |")


def _shapes_table(rounds: list[dict]) -> str:
    lines = ["| server's handler for a small unary call | wall per call | server CPU per call |",
             "|---|---:|---:|"]
    for shape, what in SHAPES.items():
        wall = statistics.median(r["floor"]["shapes"][shape]["wall_s"] for r in rounds)
        cpu = statistics.median(r["floor"]["shapes"][shape]["server_cpu_s"] for r in rounds)
        lines.append(f"| {what} | {wall * 1e3:.3f} ms | {cpu * 1e3:.3f} ms |")
    wall = statistics.median(r["ours"]["empty_call"]["wall_s"] for r in rounds)
    cpu = statistics.median(r["ours"]["empty_call"]["server_cpu_s"] for r in rounds)
    lines.append(f"| replay-server: an `Acknowledge` with nothing to acknowledge (its whole "
                 f"plumbing, no engine work) | {wall * 1e3:.3f} ms | {cpu * 1e3:.3f} ms |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
