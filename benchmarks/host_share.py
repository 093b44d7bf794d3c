"""What a client on another address sees while one address floods the call pools (issue 34).

    python benchmarks/host_share.py [--runs 2] [--calls 200]

Against a real server with the default pools (256 working calls, 1,024
waiting, 128 streams), once with ``max_host_share = 0.75`` (the default) and
once with ``1.0`` (no share: as before), interleaved, ``--runs`` times. Each
attack comes from 127.0.0.30 over raw HTTP/2 (four connections) and is held
while a client on 127.0.0.1 (the replay client, no retries) is measured:

* ``silent unary``: 256 ``Insert`` calls that never send their request;
* ``unread answers``: 256 ``Sample`` calls of 1 MiB whose answers are never read;
* ``silent streams``: 128 ``SampleStream`` calls that never send a first message.

``request_timeout_s`` and ``response_timeout_s`` are 60 s, so the flood
holds for the whole measurement. The client then makes ``--calls`` ``info``
calls (unary attacks) or opens ``--calls // 10`` streams of one batch each
(the stream attack), one after another; printed: how many were refused and
the p50/p99 of those served, and the machine's load (``uptime``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay_client import ReplayClient, errors  # noqa: E402
from replay_proto.v1 import replay_pb2 as pb  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.integration.raw_http2 import RawConnection  # noqa: E402

SERVICE = "/replay.v1.ReplayService/"
FLOODER = "127.0.0.30"
CONNECTIONS = 4
ATTACKS = {  # name: (method, calls, first message or None: the calls stay silent)
    "silent unary": ("Insert", 256, None),
    "unread answers": ("Sample", 256, pb.SampleRequest(table="big", batch_size=16)),
    "silent streams": ("SampleStream", 128, None),
}
CONFIG = """
[server]
max_host_share = {share}
request_timeout_s = 60
response_timeout_s = 60

[[tables]]
name = "big"
capacity = 100
"""


def flood(port: int, method: str, calls: int, message) -> list[RawConnection]:
    opened = []
    for i in range(CONNECTIONS):
        raw = RawConnection(port, source=FLOODER, receive_buffer=4096)
        assert raw.handshake()
        for _ in range(calls // CONNECTIONS):
            if message is None:
                raw.open_call(SERVICE + method, (("replay-request-bytes", "100"),))
            else:
                raw.call(SERVICE + method, message.SerializeToString())
        opened.append(raw)
    return opened


def held(client: ReplayClient, key: str, least: int) -> bool:
    """Whether the flood holds at least ``least`` of ``key`` (or the client is refused)."""
    try:
        return client.server_info().limits[key] >= least
    except errors.OverloadedError:
        return True


def idle(client: ReplayClient) -> bool:
    """Whether the flood's calls have all ended (the client's own call aside)."""
    try:
        now = client.server_info().limits
    except errors.OverloadedError:  # the flood's calls are still ending
        return False
    return (now["calls_in_flight"], now["calls_waiting"]) == (1, 0)


def measure(client: ReplayClient, address: str, stream: bool, calls: int) -> tuple[int, list]:
    refused, seconds = 0, []
    if stream:
        first = pb.SampleStreamRequest(request=pb.SampleRequest(
            table="big", batch_size=1, num_batches=1), credits=1).SerializeToString()
        with grpc.insecure_channel(address) as channel:
            for _ in range(calls // 10):
                start = time.perf_counter()
                try:
                    list(channel.stream_stream(SERVICE + "SampleStream")(iter([first]),
                                                                          timeout=10))
                    seconds.append(time.perf_counter() - start)
                except grpc.RpcError as exc:
                    refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return refused, seconds
    for _ in range(calls):
        start = time.perf_counter()
        try:
            client.info()
            seconds.append(time.perf_counter() - start)
        except errors.OverloadedError:
            refused += 1
    return refused, seconds


def _held_now(client: ReplayClient, key: str) -> str:
    try:
        return str(client.server_info().limits[key] - (key == "calls_in_flight"))
    except errors.OverloadedError:
        return "the whole pool"


def _figures(seconds: list[float]) -> str:
    if len(seconds) < 2:
        return "none served"
    return (f"p50 {statistics.median(seconds) * 1e3:.1f} ms, p99 "
            f"{statistics.quantiles(seconds, n=100)[98] * 1e3:.1f} ms")


def one_run(share: float, calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), CONFIG.format(share=share))
        try:
            client = ReplayClient(server.address, timeout=10, max_retry_s=0)
            client.insert("big", {"x": torch.zeros(100, 16384)})  # rows of 64 KiB
            for stream in (False, True):  # no flood: the baseline
                refused, seconds = measure(client, server.address, stream, calls)
                print(f"max_host_share = {share:g}, no flood, "
                      f"{'streams' if stream else 'info'}: {refused} refused; "
                      f"{_figures(seconds)}", flush=True)
            for name, (method, count, message) in ATTACKS.items():
                stream = method == "SampleStream"
                opened = flood(server.port, method, count, message)
                key = "streams_open" if stream else "calls_in_flight"
                deadline = time.monotonic() + 60
                while not held(client, key, int(count * share)) and (
                        time.monotonic() < deadline):
                    time.sleep(0.05)
                holds = _held_now(client, key)
                refused, seconds = measure(client, server.address, stream, calls)
                tried = calls // 10 if stream else calls
                print(f"max_host_share = {share:g}, {name} ({count} from {FLOODER}, "
                      f"holding {holds}): {refused} of {tried} refused on 127.0.0.1; "
                      f"{_figures(seconds)}", flush=True)
                for raw in opened:
                    raw.close()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not idle(client):
                    time.sleep(0.05)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"load: {os.getloadavg()}")
    for _ in range(args.runs):
        for share in (0.75, 1.0):  # interleaved
            one_run(share, args.calls)
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
