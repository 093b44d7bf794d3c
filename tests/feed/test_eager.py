"""runs_eagerly: what compiled code calls through it runs as plain Python, at no import cost."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from replay_feed.eager import runs_eagerly


def _through_numpy(x: torch.Tensor) -> torch.Tensor:
    """What a client's codec does with a batch: NumPy writes into the tensor's memory."""
    out = torch.empty_like(x)
    np.copyto(out.numpy(), x.numpy() * 2)
    return out


def test_a_compiled_caller_runs_the_marked_function_eagerly() -> None:
    """Traced, the NumPy write fails (a fake tensor has no memory); marked, the compiled
    function breaks its graph around it and gives the eager result, with no recompilation
    on later calls."""
    eager = runs_eagerly(_through_numpy)

    def step(x: torch.Tensor) -> torch.Tensor:
        return eager(x + 1).sum() * 3

    compiled = torch.compile(step, backend="eager")
    x = torch.arange(6.0)
    assert compiled(x).item() == step(x).item() == 3 * 2 * (x + 1).sum().item()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            assert compiled(x).item() == 126.0
    assert eager.__name__ == "_through_numpy" and eager.__doc__ == _through_numpy.__doc__


def test_outside_compilation_the_function_is_called_as_it_is() -> None:
    eager = runs_eagerly(_through_numpy)
    assert torch.equal(eager(torch.ones(2)), torch.full((2,), 2.0))


def test_importing_the_client_does_not_import_dynamo() -> None:
    """torch._dynamo takes about 1.5 s to import: an actor process that never compiles must
    not pay it for the marks on the client's methods. (TensorDict imports it anyway: the
    TorchRL buffer pays it there, not here.)"""
    code = "import sys, replay_client; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
