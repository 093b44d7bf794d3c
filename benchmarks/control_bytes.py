"""Control bytes of legitimate workloads: what ``server.max_control_bytes_per_s`` must allow.

    python benchmarks/control_bytes.py [--seconds 5] [--rows 64,256]

Runs a server in this process (``EmbeddedServer``, listening on 127.0.0.1, the
control-frame meter on) and, one after another, each workload at full speed
on its own connection over gRPC:

* ``learner R``: a ``SampleStream`` of batches of R Atari rows (4x84x84 bytes,
  28 KB each), ``shared_memory=False`` (the batches cross the socket, so the
  learner's WINDOW_UPDATEs and flow-control PINGs are all there);
* ``actor``: one-row inserts (17 floats), one call after another;
* ``actor batched``: 32-row inserts;
* ``actor atari``: inserts of 256 Atari rows (7.2 MB: two messages of a chunked
  insert at the default ``max_message_mb``), one call after another;
* ``info``: ``info()`` calls, one after another (the smallest unary call).

For each it prints what the connection's socket received beyond its message
bytes (raw overhead: HEADERS, frame headers, WINDOW_UPDATEs, PINGs), per call
and per MB the server sent it, and the meter's peak: the most control bytes
(beyond the allowances too, see ``replay_server.service.control_meter``) one
connection sent within one window (0: the allowances always covered it).
Client and server share this interpreter, so rates are lower than across
processes; the ratio of control to work is what matters.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from replay_client import ReplayClient
from replay_server.app import EmbeddedServer
from replay_server.engine.config import TableConfig
from replay_server.service.control_meter import WINDOW_S
from replay_server.service.settings import ServerSettings


def run(seconds: float, workload: str, client: ReplayClient) -> str:
    """Run ``workload`` for ``seconds`` (bounded in count too); what it did."""
    deadline = time.monotonic() + seconds
    done = 0
    if workload.startswith("learner"):
        rows = int(workload.split()[1])
        stream = client.stream("atari", rows, prefetch=4, shared_memory=False)
        for _ in stream:
            done += 1
            if time.monotonic() >= deadline or done >= 100_000:
                break
        stream.close()
        return f"{done} batches ({done * rows * 28_224 / 1e6 / seconds:.0f} MB/s)"
    if workload == "actor atari":
        frames = {"obs": torch.randint(0, 255, (256, 4, 84, 84), dtype=torch.uint8)}
        while time.monotonic() < deadline and done < 100_000:
            client.insert("atari", frames)
            done += 1
        return f"{done} calls ({done / seconds:.0f}/s, {done * 7.2 / seconds:.0f} MB/s)"
    rows = {"actor": 1, "actor batched": 32}.get(workload, 0)
    data = {"x": torch.zeros((rows, 17))}
    while time.monotonic() < deadline and done < 1_000_000:
        if rows:
            client.insert("small", data)
        else:
            client.info()
        done += 1
    return f"{done} calls ({done / seconds:.0f}/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rows", default="64,256")
    args = parser.parse_args()
    settings = ServerSettings(address="127.0.0.1:0", tables=(
        TableConfig(name="atari", capacity=512), TableConfig(name="small", capacity=10_000)))
    with EmbeddedServer(settings) as server:
        guard = server._server.connections  # the benchmark reads the meter's figures
        meter = guard.control if guard is not None else None
        if meter is None:
            raise SystemExit("no control-frame meter on this platform")
        with ReplayClient(server.address, timeout=60) as filler:
            filler.insert("atari", {"obs": torch.zeros((512, 4, 84, 84), dtype=torch.uint8)})
        seen: dict[tuple[str, int], tuple[int, int]] = {}
        judge = meter.over

        def over(address: tuple[str, int], received: int, sent: int, now: float) -> int:
            seen[address] = (received, sent)  # the socket's counts at the guard's last look
            return judge(address, received, sent, now)

        meter.over = over  # type: ignore[method-assign]
        workloads = [f"learner {r}" for r in args.rows.split(",")]
        workloads += ["actor", "actor batched", "actor atari", "info"]
        print(f"load average {os.getloadavg()[0]:.1f}; limit {meter.limit} B/s, "
              f"{meter.allowed} B per {WINDOW_S:g} s window")
        for workload in workloads:
            with ReplayClient(server.address, timeout=60) as client:
                client.info()  # connected
                meter.peak = 0
                time.sleep(0.5)  # the guard's look at this connection before
                before = figures(meter, seen)
                did = run(args.seconds, workload, client)
                time.sleep(0.5)  # ... and after (gRPC may reuse one connection for all)
                after = figures(meter, seen)
                address = max(after, key=lambda a: after[a][2] - before.get(a, (0,) * 5)[2])
                received, sent, calls, messages, nbytes = (
                    x - y for x, y in zip(after[address], before.get(address, (0,) * 5)))
                raw = received - nbytes
                print(f"{workload:>14}: {did}; {calls} calls, {messages} messages, "
                      f"{nbytes / 1e6:.1f} MB in, {sent / 1e6:.1f} MB out; overhead {raw} B "
                      f"({raw / max(calls, 1):.0f} B a call, {raw / max(messages, 1):.0f} B a "
                      f"message, {raw / max(sent / 1e6, 1e-9):.0f} B per MB out, "
                      f"{raw / args.seconds:.0f} B/s); peak control {meter.peak} B per window "
                      f"(cut: {meter.cut})")


def figures(meter, seen) -> dict:
    """Per connection: (received, sent, calls, messages, message bytes) at the last look."""
    with meter._lock:
        return {address: (*seen[address], account.calls, account.messages,
                          account.message_bytes)
                for address, account in meter._accounts.items() if address in seen}

if __name__ == "__main__":
    main()
