"""Memory waiters are served in turn per address: a crowd of large calls from one address
cannot starve another address's calls (issue 34, "reservations are granted fairly").

A real server with a 64 MiB budget (48 MiB for calls over 1 MiB: two 20 MiB inserts at
once); a crowd of real clients inserting 20 MiB at a time from 127.0.0.3 (through a
loopback proxy whose connections to the server come from that address), each call waiting
for room; a legitimate client on 127.0.0.1 inserting 20 MiB with no retries of its own,
so every refusal counts. A waiting call is refused after a second (``ADMISSION_WAIT_S``): served
first come first served, the legitimate call waits behind the crowd's fourteen waiters
(seven rounds of two) and is refused; served in turn per address, it waits for one release.
A chunked call waiting to grow to its whole size holds nothing meanwhile: else the crowd's
calls, each holding its first message while it waited, filled the large calls' share and
none could grow.
"""

from __future__ import annotations

import threading
import time

import torch

from replay_client import ReplayClient, errors
from tests.conftest import wait_for
from tests.tools.proxy import LinkProxy

CONFIG = """
[server]
memory_budget_mb = 64
max_batch_mb = 24

[[tables]]
name = "frames"
capacity = 64
"""
ROWS, ROW = 20, (1 << 20,)  # 20 MiB per insert: chunked, 20 MiB + a message reserved
CROWD = 16                  # concurrent inserters from the crowded address
LEGIT_CALLS = 12


def payload(n: int = ROWS) -> dict[str, torch.Tensor]:
    return {"pixels": torch.zeros(n, *ROW, dtype=torch.uint8)}


def test_a_crowd_of_large_waiters_from_one_address_does_not_starve_another(
        server_factory) -> None:
    server = server_factory(CONFIG)
    stop = threading.Event()
    crowd_done = [0] * CROWD

    def inserter(index: int, address: str) -> None:
        with ReplayClient(address, timeout=60, max_retry_s=0) as client:
            for _ in range(200):  # bounded: the test stops the crowd long before
                if stop.is_set():
                    return
                try:
                    client.insert("frames", payload())
                    crowd_done[index] += 1
                except errors.OverloadedError:
                    pass

    with LinkProxy(server.address, source="127.0.0.3") as proxy:
        threads = [threading.Thread(target=inserter, args=(i, proxy.address))
                   for i in range(CROWD)]
        for thread in threads:
            thread.start()
        try:
            with ReplayClient(server.address, timeout=60, max_retry_s=0) as legit:
                assert wait_for(lambda: sum(crowd_done) >= CROWD, timeout=120)  # the crowd runs
                refused, waited = 0, []
                for _ in range(LEGIT_CALLS):
                    start = time.monotonic()
                    try:
                        legit.insert("frames", payload())
                    except errors.OverloadedError:
                        refused += 1
                    waited.append(time.monotonic() - start)
                crowd_calls = sum(crowd_done)
                stop.set()
                print(f"\n{CROWD} inserters of 20 MiB from 127.0.0.3 ({crowd_calls} stored); "
                      f"a client on 127.0.0.1: {refused} of {LEGIT_CALLS} inserts refused, "
                      f"answered after {min(waited):.2f} to {max(waited):.2f} s")
                # Measured (2 shared cores): 0 of 12 refused alone, 3 of 12 with another
                # test file running beside it; first come first served, 8 of 12 alone.
                assert refused * 4 <= LEGIT_CALLS
                assert wait_for(lambda: legit.server_info().limits["memory_in_use_bytes"] == 0,
                                timeout=60)
        finally:
            stop.set()
            for thread in threads:
                thread.join(120)
