"""Where a learner's batches go and whether they are pinned, decided once per stream.

``pin_memory="auto"`` pins when an accelerator is present; ``True`` without
one, or a device the process does not have, is an error naming what is
missing (never a silent no-op: TorchRL's issue #2404 was pinning that quietly
did nothing). What was decided is one line, :attr:`Delivery.note`, that the
stream reports in its stats and log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from replay_feed.accelerator import Accelerator, detect_accelerator

_DETECT: Any = object()


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where batches go and whether they are pinned.

    Attributes:
        device: the device batches are copied to (None: they stay on the host).
        pin: whether what the learner receives (or the device copy reads) is page-locked.
        accelerator: the accelerator doing pinning and copies (None: none present).
        note: one line saying what was decided and why (``pin_memory="auto"`` reports here).
    """

    device: torch.device | None
    pin: bool
    accelerator: Accelerator | None
    note: str


def resolve_delivery(device: Any, pin_memory: bool | str, accelerator: Any = _DETECT) -> Delivery:
    """Check ``device`` and ``pin_memory`` against the accelerator this process has.

    Raises:
        ValueError: ``pin_memory`` is not True, False or "auto"; ``pin_memory=True``
            or a non-CPU ``device`` without a matching accelerator (the message
            says what is missing, never a silent no-op).
    """
    accel = detect_accelerator() if accelerator is _DETECT else accelerator
    if not (isinstance(pin_memory, bool) or pin_memory == "auto"):
        raise ValueError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")
    try:
        target = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if target is not None and target.type == "cpu":
        target = None
    if target is not None and (accel is None or target.type != accel.device_type):
        have = "no accelerator" if accel is None else f"only {accel.device_type}"
        raise ValueError(f"device={device!r} but this process has {have} "
                         f"(torch.cuda.is_available() is {torch.cuda.is_available()})")
    if pin_memory is True and accel is None:
        raise ValueError("pin_memory=True needs an accelerator and this process has none "
                         "(torch.cuda.is_available() is False); pinned memory would help no "
                         "copy: use pin_memory='auto' or False")
    pin = accel is not None if pin_memory == "auto" else bool(pin_memory)
    if pin:
        note = f"batches pinned for {accel.device_type if accel else '?'}"
    elif accel is None:
        note = "batches not pinned: no accelerator in this process"
    else:
        note = "batches not pinned (pin_memory=False)"
        if target is not None:
            note += ": device copies are synchronous"
    if target is not None:
        note += f"; copied to {target} on a side stream"
    return Delivery(target, pin, accel, note)
