"""Running one side of a side-by-side benchmark in its own process (and virtualenv), and our server."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path


def run_side(cmd: list[str], timeout: float) -> dict | None:
    """Run ``cmd`` and return the last JSON object it printed; ``None`` (reported) if it failed."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"  timed out: {' '.join(cmd)}", file=sys.stderr)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}",
              file=sys.stderr)
        return None
    return json.loads(lines[-1])


def tree_envs(baseline: Path | None) -> dict[str, dict[str, str]]:
    """Each side's environment for an A/B of two checkouts: ``this`` (the environment as it
    is), and, given ``baseline``, that tree's packages first on ``PYTHONPATH``."""
    sides = {"this": dict(os.environ)}
    if baseline is None:
        return sides
    roots = [baseline / part for part in ("proto", "feed", "server", "client")]
    missing = [str(r) for r in roots if not r.is_dir()]
    if missing:
        raise SystemExit(f"--baseline-tree {baseline}: no {missing} (a replay-server checkout?)")
    return {"baseline": {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, roots))}, **sides}


@contextmanager
def replay_server(
    tmp: Path, config: str, *, log_path: Path | None = None, start_timeout_s: float = 60.0,
    stop_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Run ``replay-server serve`` with the TOML ``config`` in its own process; yield its address.

    It listens on 127.0.0.1 (any free port); its output goes to ``log_path``
    (default: discarded). At exit it gets SIGTERM (drain, final checkpoint if
    configured), and is killed if it has not exited within ``stop_timeout_s``.
    """
    config_path = tmp / "bench.toml"
    config_path.write_text(config)
    port_file = tmp / "port"
    port_file.unlink(missing_ok=True)
    log = open(log_path, "w") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "replay_server.app.cli", "serve", "--config", str(config_path),
         "--address", "127.0.0.1:0", "--port-file", str(port_file)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("replay-server did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log_path is not None:
            log.close()  # type: ignore[union-attr]


def shard_servers(stack: ExitStack, tmp: Path, count: int, config: Callable[[int], str]
                  ) -> list[str]:
    """``count`` servers (``config(shard)`` each, in a folder of ``tmp``), stopped when
    ``stack`` closes; their addresses in shard order."""
    addresses = []
    for shard in range(count):
        folder = tmp / f"shard{shard}"
        folder.mkdir()
        addresses.append(stack.enter_context(replay_server(folder, config(shard))))
    return addresses


def median_ratio(this: Sequence[dict], baseline: Sequence[dict], key: str) -> float:
    """The median over rounds of ``this[i][key] / baseline[i][key]`` (each round's pair ran
    one after the other: load drifts less within a pair)."""
    return statistics.median(t[key] / b[key] for t, b in zip(this, baseline))
