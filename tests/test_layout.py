"""The import direction the design fixes: replay_proto <- engine <- service <- app.

Checked statically (by reading imports), so a violation fails even in code no
test executes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "replay_proto": ROOT / "proto" / "replay_proto",
    "replay_server": ROOT / "server" / "replay_server",
    "replay_client": ROOT / "client" / "replay_client",
}
# Modules of replay_server that may talk to the network (the service and the app).
SERVER_NETWORK_PARTS = {"service", "cli.py", "embedded.py"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _modules(package: str):
    return sorted(PACKAGES[package].rglob("*.py"))


def test_replay_proto_imports_neither_server_nor_client():
    for path in _modules("replay_proto"):
        assert not _imports(path) & {"replay_server", "replay_client"}, path


def test_server_and_client_never_import_each_other():
    for path in _modules("replay_server"):
        assert "replay_client" not in _imports(path), path
    for path in _modules("replay_client"):
        assert "replay_server" not in _imports(path), path


def test_engine_never_imports_grpc():
    engine = [
        path
        for path in _modules("replay_server")
        if path.relative_to(PACKAGES["replay_server"]).parts[0] not in SERVER_NETWORK_PARTS
    ]
    assert len(engine) >= 10
    for path in engine:
        assert not _imports(path) & {"grpc", "grpcio"}, path


def test_engine_never_imports_the_service_or_the_app():
    app = ("replay_server.service", "replay_server.cli", "replay_server.embedded")
    for path in _modules("replay_server"):
        if path.relative_to(PACKAGES["replay_server"]).parts[0] in SERVER_NETWORK_PARTS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert not name.startswith(app), f"{path} imports {name}"


def test_no_module_is_over_600_lines():
    for package in PACKAGES:
        for path in _modules(package):
            assert len(path.read_text().splitlines()) <= 600, path
