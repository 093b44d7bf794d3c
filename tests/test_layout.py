"""The import rules the design fixes, checked on every module (submodules included).

Packages: ``replay_proto`` (the wire) <- ``replay_feed`` (the learner runtime) <-
``replay_client`` and ``replay_server``; inside ``replay_server`` the layers
``engine`` <- ``checkpoint`` <- ``service`` <- ``app``, with ``errors`` shared
by all. Checked statically, by reading every import statement (function-level
and ``TYPE_CHECKING`` ones too), so a violation fails even in code no test
executes; "reaches" follows imports transitively through our own modules.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "replay_proto": ROOT / "proto" / "replay_proto",
    "replay_feed": ROOT / "feed" / "replay_feed",
    "replay_server": ROOT / "server" / "replay_server",
    "replay_client": ROOT / "client" / "replay_client",
}
NETWORK = ("grpc", "grpc_health")


def _module_name(package: str, path: Path) -> str:
    parts = path.relative_to(PACKAGES[package]).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


@cache
def _modules() -> dict[str, Path]:
    """Every first-party module by dotted name."""
    return {
        _module_name(package, path): path
        for package, root in PACKAGES.items()
        for path in sorted(root.rglob("*.py"))
    }


@cache
def _imports(module: str) -> frozenset[str]:
    """Dotted names ``module`` imports: our modules where they resolve, else top-level names."""
    path = _modules()[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(_resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in _modules()
                          else _resolve(base))
    return frozenset(found)


def _resolve(name: str) -> str:
    """``name`` if it is one of our modules (or the longest one containing it), else its top level."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in _modules():
            return candidate
    return parts[0]


@cache
def _reaches(module: str) -> frozenset[str]:
    """Everything ``module`` imports, transitively through our own modules."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in _imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                if name in _modules():
                    todo.append(name)
    return frozenset(seen)


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _modules_in(*prefixes: str) -> list[str]:
    found = [m for m in _modules() if _in(m, *prefixes)]
    assert found, f"no modules under {prefixes}"
    return found


def test_every_package_is_found() -> None:
    assert {m.split(".")[0] for m in _modules()} == set(PACKAGES)
    assert len(_modules_in("replay_server.engine")) >= 15


@pytest.mark.parametrize("module", _modules_in("replay_proto"))
def test_the_wire_imports_no_runtime_server_or_client(module: str) -> None:
    assert not any(_in(m, "replay_feed", "replay_server", "replay_client")
                   for m in _imports(module)), module


@pytest.mark.parametrize("module", _modules_in("replay_feed"))
def test_the_runtime_imports_neither_server_nor_client(module: str) -> None:
    assert not any(_in(m, "replay_server", "replay_client") for m in _imports(module)), module


def test_server_and_client_never_import_each_other() -> None:
    for module in _modules_in("replay_server"):
        if _in(module, RAY):
            continue  # the layer above both (test_ray_sits_above_the_app_and_uses_the_front_door)
        assert not any(_in(m, "replay_client") for m in _imports(module)), module
    for module in _modules_in("replay_client"):
        assert not any(_in(m, "replay_server") for m in _imports(module)), module


FRONT_DOOR = ("replay_client", "replay_client.client")
"""The only modules of the client that may import the sharded one: the package and the factory."""


@pytest.mark.parametrize("module", [m for m in _modules_in("replay_client")
                                    if m not in FRONT_DOOR and not _in(m, "replay_client.sharded")])
def test_only_the_front_door_imports_the_sharded_client(module: str) -> None:
    """The sharded client is a layer over one-server clients, never the other way up: no
    module imports it but the factory (and whoever uses the factory, like any user)."""
    assert not any(_in(m, "replay_client.sharded") for m in _imports(module)), (
        module, sorted(m for m in _imports(module) if _in(m, "replay_client.sharded")))


def test_the_one_server_client_reaches_nothing_of_the_sharded_one() -> None:
    reached = _reaches("replay_client.server_client")
    assert not any(_in(m, "replay_client.sharded") for m in reached)
    assert any(_in(m, "replay_client.sharded") for m in _reaches("replay_client.client"))


@pytest.mark.parametrize("module", _modules_in("replay_server.engine"))
def test_the_engine_reaches_no_network_and_no_layer_above_it(module: str) -> None:
    above = ("replay_server.checkpoint", "replay_server.service", "replay_server.app",
             "replay_feed", "replay_client")
    reached = _reaches(module)
    assert not set(NETWORK) & reached, f"{module} reaches {set(NETWORK) & reached}"
    assert not any(_in(m, *above) for m in reached), (
        module, sorted(m for m in reached if _in(m, *above)))


DECLARATIONS = ("replay_proto.dtype_names", "replay_server.engine.options",
                "replay_server.engine.slot_memory", "replay_server.engine.sampler_kinds",
                "replay_server.engine.reader_options", "replay_server.engine.storage_kinds",
                "replay_server.engine.rate_limiter", "replay_server.engine.schema",
                "replay_server.engine.config", "replay_server.engine.table_memory")
"""What a config means (its layers' names, options, checks and memory): read by
``check-config``, which must answer without loading torch (issue 32, friction 7)."""


@cache
def _loaded_by(module: str) -> frozenset[str]:
    """What importing ``module`` runs: its parent packages and the imports at its top level
    (not those in functions or under ``TYPE_CHECKING``), resolved as :func:`_imports` does."""
    tree = ast.parse(_modules()[module].read_text())
    package = module if _modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    found = {p for p in (package.rsplit(".", n)[0] for n in range(package.count(".") + 1))
             if p != module}
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(_resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            base = node.module or ""
            found.update(_resolve(f"{base}.{alias.name}") for alias in node.names)
    return frozenset(found)


@pytest.mark.parametrize("module", DECLARATIONS)
def test_the_config_declarations_load_neither_torch_nor_grpc(module: str) -> None:
    loaded, todo = set(), [module]
    while todo:
        for name in _loaded_by(todo.pop()) - loaded:
            loaded.add(name)
            if name in _modules():
                todo.append(name)
    heavy = {"torch", "tensordict", *NETWORK} & loaded
    assert not heavy, f"importing {module} loads {sorted(heavy)}"


def test_the_declarations_check_would_see_torch() -> None:
    assert "torch" in _loaded_by("replay_server.engine.sumtree")
    assert "torch" not in _loaded_by("replay_server.engine.schema")  # under TYPE_CHECKING


@pytest.mark.parametrize("module", _modules_in("replay_server.checkpoint"))
def test_checkpoints_reach_no_network_service_or_app(module: str) -> None:
    reached = _reaches(module)
    assert not set(NETWORK) & reached, module
    assert not any(_in(m, "replay_server.service", "replay_server.app") for m in reached), module


@pytest.mark.parametrize("module", _modules_in("replay_server.service"))
def test_the_service_never_imports_the_app(module: str) -> None:
    assert not any(_in(m, "replay_server.app") for m in _reaches(module)), module


ENGINE_FRONT = "replay_server.engine"
"""What the layers above the engine import from it: the package itself, whose names are the
engine's public face, never one of its modules (a storage backend, the table's parts)."""


@pytest.mark.parametrize("module", _modules_in("replay_server.checkpoint", "replay_server.service",
                                               "replay_server.app", "replay_server.ray"))
def test_upper_layers_import_the_engines_front_module_not_its_insides(module: str) -> None:
    insides = sorted(m for m in _imports(module) if _in(m, ENGINE_FRONT) and m != ENGINE_FRONT)
    assert not insides, (module, insides)


def test_the_front_door_check_would_see_an_inside_import() -> None:
    """The resolver tells a name from the front (``from replay_server.engine import Table``)
    from a module of the engine (``from replay_server.engine import table``)."""
    assert ENGINE_FRONT in _imports("replay_server.service.servicer")
    assert "replay_server.engine.table" in _imports("replay_server.engine.table_set")


def test_the_server_packages_root_is_the_engine_and_the_errors() -> None:
    assert not set(NETWORK) & _reaches("replay_server"), "import replay_server must not load grpc"
    assert not any(_in(m, "replay_server.engine", "replay_server.checkpoint",
                       "replay_server.service", "replay_server.app", "replay_feed")
                   for m in _reaches("replay_server.errors"))


def test_there_is_no_import_cycle() -> None:
    graph = {m: sorted(i for i in _imports(m) if i in _modules() and i != m) for m in _modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_would_see_a_cycle() -> None:
    """The resolver maps a ``from package import module`` to the module (what cycles go through)."""
    assert "replay_client.connection" in _imports("replay_client.server_client")
    assert "replay_server.engine.table" in _imports("replay_server.engine.table_set")


@pytest.mark.parametrize("module", sorted(m for m in _modules()
                                           if not _in(m, "replay_proto.v1")))  # protoc's output
def test_no_module_is_over_600_lines(module: str) -> None:
    assert len(_modules()[module].read_text().splitlines()) <= 600, module


@pytest.mark.parametrize("module", _modules_in("replay_server.engine.samplers"))
def test_samplers_know_positions_only_never_storage_readers_or_the_table(module: str) -> None:
    """A sampler sees the id ring and the insert events: never the rows, the readers that
    shape them, the remover that counts draws, the config or the table that wires it."""
    banned = ("replay_server.engine.storage", "replay_server.engine.readers",
              "replay_server.engine.remover",
              "replay_server.engine.config", "replay_server.engine.table",
              "replay_server.engine.table_parts", "replay_server.engine.table_state",
              "replay_server.engine.table_memory")
    reached = _reaches(module)
    assert not any(_in(m, *banned) for m in reached), (
        module, sorted(m for m in reached if _in(m, *banned)))


_LAYERS = {
    "samplers": "replay_server.engine.samplers",
    "remover": "replay_server.engine.remover",
    "storage": "replay_server.engine.storage",
    "readers": "replay_server.engine.readers",
}
_WIRING = ("replay_server.engine.table", "replay_server.engine.table_parts",
           "replay_server.engine.table_state", "replay_server.engine.table_memory")
_COMPOSED = (*_WIRING, "replay_server.engine.config")
"""The table's modules, and its config (the table's options plus each layer's spec)."""


def _layers_imported(module: str) -> set[str]:
    return {name for name, prefix in _LAYERS.items()
            if any(_in(m, prefix) for m in _imports(module)) and not _in(module, prefix)}


@pytest.mark.parametrize("module", _modules_in("replay_server.engine.storage"))
def test_storage_knows_columns_only_never_samplers_readers_or_the_table(module: str) -> None:
    banned = (_LAYERS["samplers"], _LAYERS["remover"], _LAYERS["readers"], *_WIRING)
    assert not any(_in(m, *banned) for m in _imports(module)), (
        module, sorted(m for m in _imports(module) if _in(m, *banned)))


@pytest.mark.parametrize("module", _modules_in("replay_server.engine.readers"))
def test_readers_read_through_one_another_never_samplers_storage_or_the_table(
        module: str) -> None:
    """A reader sees positions and the reader below it: never who drew them (samplers, the
    remover), how rows are kept (storage backends) or the table that wires it."""
    banned = (_LAYERS["samplers"], _LAYERS["remover"], _LAYERS["storage"], *_WIRING,
              "replay_server.engine.config")
    reached = _reaches(module)
    assert not any(_in(m, *banned) for m in reached), (
        module, sorted(m for m in reached if _in(m, *banned)))


def test_the_table_is_the_only_place_that_wires_the_layers() -> None:
    """Outside the table's four modules and its config (which holds each layer's spec), no
    module imports from two of the layers."""
    wiring = {m: _layers_imported(m) for m in _modules_in("replay_server")}
    assert {m for m, layers in wiring.items() if len(layers) > 1} <= set(_COMPOSED), {
        m: layers for m, layers in wiring.items() if len(layers) > 1 and m not in _COMPOSED}
    assert wiring["replay_server.engine.table_parts"] >= {"samplers", "remover", "storage",
                                                          "readers"}


RAY = "replay_server.ray"
"""Shards as Ray actors: above ``replay_server.app`` (it runs embedded servers), and the one
server package that uses the client (``ReplayCluster.client``), through its front door."""


def test_ray_sits_above_the_app_and_uses_the_front_door() -> None:
    for module in _modules():
        if not _in(module, RAY):
            assert not any(_in(m, RAY) for m in _imports(module)), (module, "imports", RAY)
    for module in _modules_in(RAY):
        clients = {m for m in _imports(module) if _in(m, "replay_client")}
        assert clients <= {"replay_client"}, (module, sorted(clients))
    assert "ray" not in _reaches("replay_server"), "import replay_server must not load Ray"


def _top_level_imports(module: str) -> set[str]:
    """Top-level names ``module`` imports at module level (not in functions)."""
    tree = ast.parse(_modules()[module].read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_client_works_without_ray() -> None:
    """Only the ``ray://`` resolver imports Ray, inside the function that needs it."""
    for module in _modules_in("replay_client", "replay_feed", "replay_proto"):
        assert "ray" not in _top_level_imports(module), module
        if module != "replay_client.sharded.ray_registry":
            assert "ray" not in _imports(module), module
    assert "ray" in _imports("replay_client.sharded.ray_registry")
