"""Calls that reach the server run eagerly inside ``torch.compile``: the compiled code breaks its graph around them.

A learner compiles its training step, and the step samples and updates
priorities (``rb.extend(data); batch = rb.sample()`` is TorchRL's own
compile test). Traced, a client call is socket and protobuf work with no
tensor program in it: Dynamo failed on it ("Guard failed on the same frame
it was created", or a fake tensor handed to NumPy) and the compiled step
never ran. :func:`runs_eagerly` marks a method so that, while Dynamo traces,
the call is made through ``torch.compiler.disable``: a graph break, the call
itself run as plain Python, and tracing resumes with its result.

Cost: outside compilation one ``torch.compiler.is_compiling()`` check per
call (0.17 us here; a call to the server takes tens of microseconds).
``torch._dynamo`` (1.5 s to import here) is imported only by a compilation
that is already running, never by the client.

Thread-safety: stateless.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def runs_eagerly(fn: F) -> F:
    """Decorate ``fn`` so that a compiled caller runs it eagerly (see the module docstring)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn, recursive=True)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
