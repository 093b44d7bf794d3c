"""Every Python and TOML example in README.md and docs/*.md works as written.

Python blocks run in order, each in a fresh namespace, against one real server
with the default tables and a checkpoint directory (``localhost:50051`` in the
text is rewritten to its address); TOML blocks must load as server configs.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from replay_server.app.config_file import settings_from_dict

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


ELSEWHERE = {"localhost:50061": "runs against the doc's three shards in "
                                  "tests/integration/test_scale_out_docs.py"}
"""Blocks that need more than the one server: what marks them, and where they run."""


def _blocks(language: str) -> list:
    pattern = re.compile(rf"```{language}\n(.*?)```", re.DOTALL)
    return [
        pytest.param(code, id=f"{path.name}:{n}", marks=[
            pytest.mark.skip(reason=why) for mark, why in ELSEWHERE.items() if mark in code])
        for path in DOCS
        for n, code in enumerate(pattern.findall(path.read_text()), start=1)
    ]


PYTHON = _blocks("python")
TOML = _blocks("toml")


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    from tests.conftest import start_server

    tmp = tmp_path_factory.mktemp("docs")
    proc = start_server(tmp, f'[server]\ncheckpoint_dir = "{tmp / "checkpoints"}"\n'
                             f'checkpoint_interval_s = 0\n')
    yield proc.address
    proc.stop()


def test_readme_has_client_examples():
    assert any("README" in p.id and "ReplayClient" in p.values[0] for p in PYTHON)


@pytest.mark.parametrize("code", PYTHON)
def test_no_example_wipes_a_table_the_quickstart_filled(code):
    """Issue 32, friction 10: docs/torchrl.md's blocks called ``rb.empty()`` on the default
    tables of ``make serve``'s server, wiping the rows the README's blocks had put there. A
    block that empties or resets a table uses a table of its own (an embedded server's)."""
    from replay_server import default_table_configs

    if not re.search(r"\.empty\(\)|\.reset\(", code):
        return
    defaults = {config.name for config in default_table_configs()}
    named = set(re.findall(r'"localhost:50051",\s*"(\w+)"', code))
    named |= set(re.findall(r'\.reset\(\s*"(\w+)"', code))
    assert not named & defaults, f"this block empties or resets default table(s) {named}"


@pytest.mark.parametrize("code", PYTHON)
def test_python_example_runs(code, address, monkeypatch):
    code = code.replace("localhost:50051", address)
    # A doc's ray.init() starts a Ray of its own, as on a user's machine: without this it joins
    # the newest cluster started here (Ray's /tmp/ray/ray_current_cluster), which can be a Ray
    # test's in the other worker, and refuses the doc's num_cpus there.
    monkeypatch.setenv("RAY_ADDRESS", "local")
    # dont_inherit: the example runs as a user's file would, without this module's
    # ``from __future__ import annotations`` (a dataclass in it needs real annotations)
    exec(compile(code, "<doc example>", "exec", dont_inherit=True),
         {"__name__": "__doc_example__"})


@pytest.mark.parametrize("code", TOML)
def test_toml_example_is_a_valid_config(code):
    import tomllib

    settings_from_dict(tomllib.loads(code))


# ------------------------------------------------------- what the docs name exists

NAMED_DOCS = [*DOCS, *sorted(ROOT.glob("examples/*/README.md"))]

MADE_AT_RUN_TIME = {
    "./checkpoints", "checkpoints",  # make serve's checkpoint_dir
    "manifest.json",                 # inside each checkpoint (docs/durability.md)
    "dqn_cartpole.png",              # written by make demo
    "gpu-check", "report.md", "report.json",  # written by make gpu-check
    ".whl",                          # benchmarks/gpu_wheels.sh's download folder
}
"""Files the docs name that a run makes, not the repository (and ``.venv*``: the set-up's)."""


def _tracked() -> list[str]:
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    if listed.returncode == 0 and listed.stdout:
        return listed.stdout.splitlines()
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".git" not in p.parts]


def _prose(text: str) -> str:
    """``text`` without its fenced blocks (their backticks are not code spans)."""
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def _named_paths() -> list:
    found = {}
    for path in NAMED_DOCS:
        for token in re.findall(r"`([^`\s]+)`", _prose(path.read_text())):
            if (re.search(r"/|\.(py|md|toml|ya?ml|sh|json|txt|proto|png|log)$", token)
                    and not re.search(r"://|=|^/|^[a-z0-9.-]+\.(io|com)/", token)):
                found.setdefault((path.name, token.rstrip("/")), None)
    return [pytest.param(token, id=f"{doc}: {token}") for doc, token in found]


def _named_targets() -> list:
    found = {}
    for path in NAMED_DOCS:
        text = path.read_text()
        spans = re.findall(r"`make ([a-z][a-z0-9-]*)", _prose(text))
        lines = re.findall(r"^make ([a-z][a-z0-9-]*)", "\n".join(
            re.findall(r"```bash\n(.*?)```", text, re.DOTALL)), re.MULTILINE)
        for target in [*spans, *lines]:
            found.setdefault((path.name, target), None)
    return [pytest.param(target, id=f"{doc}: make {target}") for doc, target in found]


@pytest.mark.parametrize("named", _named_paths())
def test_every_file_the_docs_name_exists(named):
    """A path from the root, or the end of one (``engine/table.py``, ``statefulset.yaml``)."""
    if named in MADE_AT_RUN_TIME or named.startswith(".venv"):
        return
    tracked = _tracked()
    if "<" in named:  # a pattern: `engine/samplers/<name>.py` names any file of that shape
        pattern = re.sub(r"<[^>]*>", "*", named)
        assert any(fnmatch.fnmatch(f, pattern) or fnmatch.fnmatch(f, "*/" + pattern)
                   for f in tracked), f"the docs name {named!r}, which no file matches"
        return
    assert any(f == named or f.endswith("/" + named) or f.startswith(named + "/")
               or ("/" + named + "/") in ("/" + f) for f in tracked), (
        f"the docs name {named!r}, which no file in the repository is")


@pytest.mark.parametrize("target", _named_targets())
def test_every_make_target_the_docs_name_exists(target):
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(),
                             re.MULTILINE))
    assert target in targets, f"the docs name `make {target}`; the Makefile has {sorted(targets)}"


def test_the_names_are_found():
    assert len(_named_paths()) > 50 and len(_named_targets()) >= 8


def test_the_transports_the_docs_print_are_the_ones_used(address, capsys):
    """``print(stream.transport)  # grpc: ...``: the comment's first word is what prints."""
    blocks = [p.values[0] for p in PYTHON if "print(stream.transport)" in p.values[0]]
    checked = 0
    for code in blocks:
        said = re.findall(r"print\(stream\.transport\)\s*# (\w+)", code)
        exec(compile(code.replace("localhost:50051", address), "<doc example>", "exec",
                     dont_inherit=True),
             {"__name__": "__doc_example__"})
        named = {"grpc", "shared_memory", "in_process", *said}  # a doc's own transport too
        printed = [line for line in capsys.readouterr().out.splitlines() if line in named]
        assert printed == said, code
        checked += len(said)
    assert checked >= 3
