"""A step of `make gpu-check`: seconds from spawning ``replay-server serve`` to SERVING.

    python benchmarks/gpu_check_start.py

Starts the server (its default tables, 127.0.0.1, port 0) in its own process, waits for
the port file it writes once SERVING, asks its health service, stops it with SIGTERM, then
does it all once more, and prints one JSON line: ``{"serving_s": ..., "again_serving_s":
..., "health": "SERVING", "stop_s": ...}``. The first start on a fresh machine reads torch
and CUDA's libraries from a cold disk (5.6 s on a lent H200); the second is what a restart
costs once they are cached.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LIMIT_S = 45.0


def main() -> int:
    first = start_and_stop()
    again = start_and_stop()
    print(json.dumps({**first, "again_serving_s": again["serving_s"]}))
    return 0 if first["exit"] == again["exit"] == 0 else 1


def start_and_stop() -> dict:
    """One start to SERVING, a health check and a SIGTERM stop, timed."""
    with tempfile.TemporaryDirectory() as scratch:
        port_file = Path(scratch) / "port"
        started = time.monotonic()
        server = subprocess.Popen(
            [sys.executable, "-m", "replay_server.app.cli", "serve", "--address",
             "127.0.0.1:0", "--port-file", str(port_file), "--grace", "5"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = started + LIMIT_S
            while not (port_file.exists() and port_file.read_text().strip()):
                if server.poll() is not None or time.monotonic() > deadline:
                    print(server.stderr.read() if server.poll() is not None else "",
                          file=sys.stderr)
                    raise SystemExit(f"no SERVING within {LIMIT_S:g} s "
                                     f"(exit status {server.poll()})")
                time.sleep(0.01)
            serving_s = time.monotonic() - started
            address = f"127.0.0.1:{port_file.read_text().strip()}"
            with grpc.insecure_channel(address) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=10).status
            stopping = time.monotonic()
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=30)
            return {"serving_s": round(serving_s, 3),
                    "health": health_pb2.HealthCheckResponse.ServingStatus.Name(status),
                    "stop_s": round(time.monotonic() - stopping, 3), "exit": code}
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main())
