"""The generated protobuf modules are fresh: regenerating from proto/ changes nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generate_module():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_the_proto_files(tmp_path):
    generate = _generate_module()
    fresh = {p.name: p.read_text() for p in generate.generate(tmp_path / "v1")}
    committed_dir = ROOT / "proto" / "replay_proto" / "v1"
    committed = {p.name: p.read_text() for p in committed_dir.glob("*.py*")}  # .pyi too
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `make proto`: {stale} are stale"


def test_every_rpc_in_the_proto_has_a_server_handler():
    from collections import namedtuple
    from concurrent.futures import ThreadPoolExecutor

    from replay_proto.v1 import replay_pb2
    from replay_server import TableSet, default_table_configs
    from replay_server.service.servicer import ReplayServicer

    Details = namedtuple("Details", "method invocation_metadata")
    service = replay_pb2.DESCRIPTOR.services_by_name["ReplayService"]
    with ThreadPoolExecutor(1) as pool:
        handler = ReplayServicer(TableSet(default_table_configs(100)), pool, 1 << 20).handler()
    for method in service.methods:
        path = f"/{service.full_name}/{method.name}"
        served = handler.service(Details(path, ()))
        assert served is not None, path
        # Every replay RPC is served by a stream handler: it reads its request when admitted
        # and writes its answer itself (a unary one, once: the client sees a unary call), so
        # that an answer nobody reads can be given up (replay_server.service.admission).
        assert served.request_streaming and served.response_streaming, path
