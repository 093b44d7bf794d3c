"""The light commands load no torch: ``--version``, ``--help`` and the operator's commands.

Issue 24, friction 7: every command imported torch (``--version`` took 1.8 s,
``health`` 3.2 s on a loaded host; the image's HEALTHCHECK pays that every
30 s). Checked by what a fresh interpreter has imported once the command
ran, never by timing it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import module_server

server = module_server(None)  # one server with the default tables for the module

HEAVY = ("torch", "numpy", "tensordict", "replay_server.engine", "replay_server.service")

PROBE = f"""
import json, sys
from replay_server.app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def _probe(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True,
                            text=True, timeout=60, check=False)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["health", "--help"]])
def test_version_and_help_load_nothing_heavy(args):
    assert _probe(*args) == {"code": 0, "heavy": []}


def test_health_info_and_reset_load_nothing_heavy(server):
    for args in (["health"], ["info"], ["info", "--json"], ["reset", "uniform"]):
        assert _probe(*args, "--address", server.address) == {"code": 0, "heavy": []}, args


def test_a_failed_health_check_loads_nothing_heavy():
    assert _probe("health", "--address", "127.0.0.1:1") == {"code": 1, "heavy": []}


def test_serve_refuses_a_malformed_address_before_loading_anything_heavy():
    assert _probe("serve", "--address", "127.0.0.1:99999") == {"code": 2, "heavy": []}


def test_the_packages_load_nothing_until_a_name_is_used():
    probe = ("import json, sys, replay_server, replay_server.app, replay_proto; "
             "before = 'torch' in sys.modules; from replay_server import Table; "
             "from replay_proto import SampleBatch; "
             "print(json.dumps([before, 'torch' in sys.modules, Table.__name__, "
             "SampleBatch.__name__]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, check=True)
    assert json.loads(result.stdout) == [False, True, "Table", "SampleBatch"]


@pytest.mark.parametrize("package", ["replay_proto", "replay_server", "replay_server.app",
                                     "replay_server.engine", "replay_server.service",
                                     "replay_server.checkpoint"])
def test_every_exported_name_resolves(package):
    import importlib

    module = importlib.import_module(package)
    assert module.__all__ and all(getattr(module, name) is not None for name in module.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


CONFIG_PROBE = """
import json, sys
from replay_server.app.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": [m for m in ("torch", "tensordict", "grpc", "numpy",
                                                      "google.protobuf") if m in sys.modules]}))
"""


def _check_config(path) -> tuple[dict, list[str], str]:
    result = subprocess.run([sys.executable, "-c", CONFIG_PROBE, "check-config", str(path)],
                            capture_output=True, text=True, timeout=120, check=False)
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1], result.stderr


def test_check_config_loads_neither_torch_nor_grpc_nor_numpy_nor_protobuf(tmp_path):
    """Issue 32, friction 7: check-config answers like health, without torch, grpc, numpy or
    protobuf (the checks are arithmetic), every layer's declaration read (a declared schema
    sized, lz4 over memmap, frame stacks, n-step)."""
    (tmp_path / "rows").mkdir()
    config = tmp_path / "replay.toml"
    config.write_text(f"""
[server]
address = "127.0.0.1:0"

[[tables]]
name = "atari"
capacity = 1000
sampler = "prioritized"
n_step = 3
frame_stack_key = "obs"
compress_keys = ["obs"]
storage = "memmap"
storage_dir = "{tmp_path / 'rows'}"
[tables.schema]
obs = "uint8[4, 84, 84]"
reward = "float32[]"
done = "bool[]"
episode = "int64[]"

[[tables]]
name = "r2d2"
capacity = 2000
sampler = "prioritized_slice"
slice_len = 8
[tables.schema]
obs = "float32[17]"
""")
    outcome, lines, stderr = _check_config(config)
    assert outcome == {"code": 0, "heavy": []}, stderr
    assert lines[0] == f"{config}: valid"
    assert any(line.startswith("  atari: prioritized, capacity 1,000, storage=memmap")
               for line in lines), lines
    assert any(line.startswith("  r2d2: prioritized_slice, capacity 2,000") for line in lines)


def test_check_config_reports_every_problem_without_torch(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("""
[[tables]]
name = "a"
capacity = 10
sampler = "prioritised"

[[tables]]
name = "b"
capacity = 10
[tables.schema]
obs = "float8[3]"
""")
    outcome, _, stderr = _check_config(config)
    assert outcome == {"code": 2, "heavy": []}
    assert "3 problems" in stderr  # both tables', and no table left to serve
    assert "sampler must be one of" in stderr and "'prioritised'" in stderr
    assert "unknown dtype name 'float8'" in stderr
