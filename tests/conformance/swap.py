"""The pytest plugin that swaps TorchRL's buffer classes and records what each test does.

Loaded with ``-p tests.conformance.swap`` into a pytest run of TorchRL's own
test files (in a virtualenv with torchrl), before they are collected, so
their ``from torchrl.data import ReplayBuffer`` picks up the swapped names.
``CONFORMANCE_MODE`` says which classes go in:

* ``reference``: TorchRL's own classes, subclassed only to record that a test
  built a buffer, from which parts, what data it wrote (TensorDict or not)
  and which private attributes of TorchRL's buffers, storages, samplers and
  writers the test's own code read. This run decides which tests are in
  scope and which test TorchRL's internals (:mod:`tests.conformance.scope`).
* ``remote``: :mod:`tests.conformance.buffers`: ``RemoteReplayBuffer`` on a
  table of a real server (:mod:`tests.conformance.servers`) that matches the
  buffer's storage and sampler, the test's assertions unchanged.

One JSON line per test goes to ``CONFORMANCE_RECORDS``: its node id, outcome,
how many buffers it built, the kinds of data it wrote, attributes it asked
for that the buffer lacks, and the error that failed it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

BUFFER_NAMES = ("ReplayBuffer", "TensorDictReplayBuffer", "PrioritizedReplayBuffer",
                "TensorDictPrioritizedReplayBuffer")
"""The public buffer classes a TorchRL script builds (and the swap replaces)."""

NAMESPACES = ("torchrl.data", "torchrl.data.replay_buffers")
"""Where scripts (and TorchRL's tests) import them from."""

TEST_TIMEOUT_S = 90


class Record:
    """What the running test did with buffers."""

    def __init__(self) -> None:
        self.buffers = 0
        self.data: set[str] = set()
        self.missing: list[str] = []
        self.parts: set[str] = set()
        self.private: set[str] = set()

    def built(self, kwargs: dict[str, Any]) -> None:
        """A buffer was built with ``kwargs``: note its parts and options (see :func:`parts_of`)."""
        self.buffers += 1
        self.parts.update(parts_of(kwargs))

    def wrote(self, data: Any) -> None:
        self.data.add(data_kind(data))


CURRENT = Record()


def data_kind(data: Any) -> str:
    """``tensordict``, ``tensorclass``, ``tensor`` or the type's name."""
    try:
        from tensordict import TensorDictBase, is_tensorclass
    except ImportError:  # pragma: no cover - tensordict comes with torchrl
        return type(data).__name__
    if is_tensorclass(data):
        return "tensorclass"
    if isinstance(data, TensorDictBase):
        return "tensordict"
    import torch

    if isinstance(data, torch.Tensor):
        return "tensor"
    return type(data).__name__


OPTION_DEFAULTS: dict[str, Any] = {
    "sample_unit": None, "checkpointer": None, "consume_after_n_samples": None,
    "dim_extend": None, "transform_factory": None, "collate_fn": None,
    "service_backend": "direct", "transport": "auto",
}
"""Options worth noting when a test sets them (what they are at TorchRL's default)."""


def parts_of(kwargs: dict[str, Any]) -> list[str]:
    """The storage, sampler and writer classes of a buffer, and the options it set:
    ``"sampler=SamplerWithoutReplacement"``, ``"storage.ndim=2"``, ``"option=sample_unit"``."""
    parts = []
    for name in ("storage", "sampler", "writer"):
        part = kwargs.get(name)
        if part is None:
            continue
        cls = part.func if hasattr(part, "func") else part if isinstance(part, type) else type(part)
        parts.append(f"{name}={getattr(cls, '__name__', type(cls).__name__)}")
        if name == "storage" and getattr(part, "ndim", 1) != 1:
            parts.append(f"storage.ndim={part.ndim}")
    for name, default in OPTION_DEFAULTS.items():
        value = kwargs.get(name, default)
        if value is not default and not (isinstance(value, str) and value == default):
            parts.append(f"option={name}")
    return parts


def _recording(base: type) -> type:
    """``base`` (one of TorchRL's classes), recording builds and writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CURRENT.built(kwargs)
        base.__init__(self, *args, **kwargs)

    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        CURRENT.wrote(data)
        return base.extend(self, data, *args, **kwargs)

    def add(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        CURRENT.wrote(data)
        return base.add(self, data, *args, **kwargs)

    def __setitem__(self, index: Any, value: Any) -> None:
        CURRENT.wrote(value)
        return base.__setitem__(self, index, value)

    namespace = {"__init__": __init__, "extend": extend, "add": add,
                 "__setitem__": __setitem__, "__module__": __name__,
                 "__qualname__": base.__name__}
    return type(base.__name__, (base,), namespace)


PRIVATE_WATCHED = ("torchrl.data.replay_buffers.replay_buffers:ReplayBuffer",
                   "torchrl.data.replay_buffers.storages:Storage",
                   "torchrl.data.replay_buffers.samplers:Sampler",
                   "torchrl.data.replay_buffers.writers:Writer")
"""TorchRL's classes whose private attributes a test may read (recorded in the reference run)."""


_WATCHED: list[tuple[type, Any, bool]] = []
"""``(class, its recording __getattribute__, whether the class defined its own before)``."""


def _watch_private(cls: type, tests_dir: str) -> None:
    """Record reads of ``cls``'s private attributes made by code in ``tests_dir``."""
    own = "__getattribute__" in cls.__dict__
    original = cls.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        if name[:1] == "_" and name[:2] != "__":
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(tests_dir):
                CURRENT.private.add(f"{type(self).__name__}.{name}")
        return original(self, name)

    __getattribute__.original = original  # type: ignore[attr-defined]
    cls.__getattribute__ = __getattribute__
    _WATCHED.append((cls, __getattribute__, own))


def _watching(on: bool) -> None:
    """Put the recording ``__getattribute__`` hooks in (``on``) or take them out: a test that
    compiles a buffer with torch.compile runs without them (dynamo cannot trace them)."""
    for cls, hook, own in _WATCHED:
        if on:
            cls.__getattribute__ = hook
        elif own:
            cls.__getattribute__ = hook.original
        elif "__getattribute__" in cls.__dict__:
            del cls.__getattribute__


def _note_ensembles(data_module: Any) -> None:
    """Record TorchRL's ``ReplayBufferEnsemble`` as a part: it composes buffers through
    their private storage and sampler, which a buffer on a server does not have."""
    ensemble = getattr(data_module, "ReplayBufferEnsemble", None)
    if ensemble is None:
        return
    original = ensemble.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        CURRENT.parts.add("ensemble=ReplayBufferEnsemble")
        original(self, *args, **kwargs)

    ensemble.__init__ = __init__


def install(mode: str) -> dict[str, type]:
    """Put the ``mode``'s classes in TorchRL's namespaces; returns them by name."""
    import importlib

    import torchrl.data as data_module

    if mode == "reference":
        classes = {name: _recording(getattr(data_module, name)) for name in BUFFER_NAMES}
        _note_ensembles(data_module)
        tests_dir = os.environ.get("CONFORMANCE_TESTS_DIR")
        if tests_dir:
            for spec in PRIVATE_WATCHED:
                module, _, name = spec.partition(":")
                _watch_private(getattr(importlib.import_module(module), name), tests_dir)
    elif mode == "remote":
        from tests.conformance import buffers

        classes = buffers.remote_classes(CURRENT)
    else:
        raise ValueError(f"CONFORMANCE_MODE must be 'reference' or 'remote', got {mode!r}")
    for name, cls in classes.items():
        globals()[name] = cls  # picklable by qualified name
        for namespace in NAMESPACES:
            setattr(importlib.import_module(namespace), name, cls)
    return classes


class _Plugin:
    def __init__(self, mode: str, records: Path) -> None:
        self.mode = mode
        self.records = records
        self.outcome: dict[str, Any] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        CURRENT.__init__()
        _watching("compile" not in nodeid)
        self.outcome = {"outcome": "passed", "error": ""}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and report.when in ("setup", "call"):
            if self.outcome["outcome"] == "passed":
                self.outcome["outcome"] = "skipped"
        elif report.failed and self.outcome["outcome"] != "failed":
            self.outcome = {"outcome": "failed", "error": _error_line(report)}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        if hasattr(signal, "SIGALRM"):
            def expire(signum: int, frame: Any) -> None:
                raise TimeoutError(f"the test ran past {TEST_TIMEOUT_S} s")

            previous = signal.signal(signal.SIGALRM, expire)
            signal.alarm(TEST_TIMEOUT_S)
            try:
                yield
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
        else:
            yield

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        if self.mode == "remote":
            from tests.conformance import buffers

            buffers.between_tests()

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        record = {"nodeid": nodeid, **self.outcome, "buffers": CURRENT.buffers,
                  "data": sorted(CURRENT.data), "missing": sorted(set(CURRENT.missing)),
                  "parts": sorted(CURRENT.parts), "private": sorted(CURRENT.private)}
        with self.records.open("a") as out:
            out.write(json.dumps(record) + "\n")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.mode == "remote":
            from tests.conformance import buffers

            buffers.shutdown()


def __getattr__(name: str) -> type:
    """The swapped classes, for a process that unpickles a buffer (a spawned worker):
    installed on first use, in the mode of the parent's environment."""
    if name in BUFFER_NAMES:
        install(os.environ.get("CONFORMANCE_MODE", "reference"))
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error_line(report: pytest.TestReport) -> str:
    """The exception that failed a test: its type and first message line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("CONFORMANCE_MODE", "reference")
    records = Path(os.environ["CONFORMANCE_RECORDS"])
    install(mode)
    config.pluginmanager.register(_Plugin(mode, records), "conformance-recorder")
    config.addinivalue_line("markers", "gpu: TorchRL's mark for GPU tests")
    print(f"conformance: {mode} buffers installed ({sys.executable})", file=sys.stderr)
