"""A step of `make gpu-check`: a cuda table's batches to a learner process, through CUDA IPC
and through host copies.

    python benchmarks/cuda_ipc.py [--rows 20000] [--seconds 3] [--batch 256] [--json PATH]

Starts ``replay-server serve`` with one ``device = "cuda"`` table of Atari rows
(4x84x84 uint8 frames) in its own process, fills it with ``--rows`` rows, then
streams batches of ``--batch`` to ``cuda`` in this process for ``--seconds`` each:
through CUDA IPC (``cuda_ipc``: views of the server's device ring), through the
shared-memory ring (host copies: the server copies each batch to the host, the
learner to the GPU) and over gRPC. Prints (and writes to ``--json``) one JSON
object: batches/s per path, the transport each stream really used and its notes
(CUDA IPC refused in a sandbox shows as ``transport: grpc`` with the reason).
Without CUDA it prints ``{"skipped": "no CUDA"}`` and exits 0. Every wait is
bounded: the server's start (60 s), the fill, and each stream (``--seconds``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

START_S = 60.0
CONFIG = """
[server]
table_memory_mb = 64

[[tables]]
name = "atari"
capacity = {rows}
sampler = "prioritized"
device = "cuda"
"""


def _serve(scratch: Path, rows: int, module: str = "replay_server.app.cli"
           ) -> tuple[subprocess.Popen, str]:
    config = scratch / "server.toml"
    config.write_text(CONFIG.format(rows=rows))
    port_file = scratch / "port"
    server = subprocess.Popen(
        [sys.executable, "-m", module, "serve", "--config", str(config),
         "--address", "127.0.0.1:0", "--port-file", str(port_file), "--grace", "5"],
        stdout=subprocess.DEVNULL, stderr=open(scratch / "server.log", "w"))
    deadline = time.monotonic() + START_S
    while not (port_file.exists() and port_file.read_text().strip()):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"the server did not serve within {START_S:g} s: "
                             f"{(scratch / 'server.log').read_text()[-2000:]}")
        time.sleep(0.02)
    return server, f"127.0.0.1:{port_file.read_text().strip()}"


def _fill(client, rows: int) -> None:
    """``rows`` Atari rows (random 4x84x84 frames), 250 (7 MB) per insert (on an H200 a
    first insert of 500 ended with the server's socket closed, cause not recorded: the
    server's log now comes with any failure)."""
    frames = torch.randint(0, 255, (250, 4, 84, 84), dtype=torch.uint8)
    for start in range(0, rows, 250):
        n = min(250, rows - start)
        client.insert("atari", {"frame": frames[:n], "action": torch.zeros(n, dtype=torch.int64)})


def _measure(client, batch: int, seconds: float, **options) -> dict:
    stream = client.stream("atari", batch, device="cuda", num_batches=1_000_000,
                           batches_per_message=1, wait_timeout=60, **options)
    count = 0
    start = time.perf_counter()
    try:
        for i, got in enumerate(stream):
            if i == 0:
                torch.cuda.synchronize()
                start = time.perf_counter()  # from the first batch: the ring is set up
                continue
            got.data["frame"][0, 0, 0, 0].item() if i % 64 == 0 else None  # touch it
            count += 1
            if time.perf_counter() - start >= seconds:
                break
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        transport, notes = stream.transport, list(stream.stats.notes)
        stream.close()
    return {"batches_per_s": round(count / elapsed, 1), "batches": count,
            "transport": transport, "notes": notes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        result: dict = {"skipped": "no CUDA"}
    else:
        from replay_client import ReplayClient, sources

        with tempfile.TemporaryDirectory() as scratch:
            server, address = _serve(Path(scratch), args.rows)
            log = Path(scratch) / "server.log"
            try:
                client = ReplayClient(address)
                _fill(client, args.rows)
                result = {"rows": args.rows, "batch": args.batch, "seconds": args.seconds,
                          "gpu": torch.cuda.get_device_name(0)}
                result["cuda_ipc"] = _measure(client, args.batch, args.seconds)
                saved = sources.SOURCES
                sources.SOURCES = {k: v for k, v in saved.items() if k != "cuda_ipc"}
                try:
                    result["shared_memory"] = _measure(client, args.batch, args.seconds)
                finally:
                    sources.SOURCES = saved
                result["grpc"] = _measure(client, args.batch, args.seconds,
                                          shared_memory=False)
                client.close()
            except Exception:  # say why: the server's log (it may have died)
                print(f"server exit status {server.poll()}; its log's end:\n"
                      f"{log.read_text()[-3000:]}", file=sys.stderr)
                raise
            finally:
                server.terminate()
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
    text = json.dumps(result)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
