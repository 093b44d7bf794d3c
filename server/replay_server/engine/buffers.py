"""New batch tensors: on the host through numpy, so that large ones are backed by huge pages.

A batch of Atari frames is tens to hundreds of megabytes, written once.
numpy asks the kernel for transparent huge pages on allocations of 4 MB
and more (``madvise(MADV_HUGEPAGE)``); torch does not, so a 144 MB batch
made by ``torch.empty`` takes about 35,000 page faults as it is first
written, and one made by numpy under a hundred (measured: a third of a
plain R2D2 batch's time). Every batch tensor the engine makes on the host
comes from :func:`empty`.

Thread-safety: any thread.
"""

from __future__ import annotations

import numpy as np
import torch

from replay_proto.dtypes import numpy_dtype, tensor_view

_HOST = torch.device("cpu")


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = _HOST
          ) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` and ``dtype`` on ``device`` (on the host: numpy's
    memory; bfloat16, which numpy lacks, as int16 viewed back)."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return tensor_view(np.empty(shape, dtype=numpy_dtype(dtype)), dtype)
