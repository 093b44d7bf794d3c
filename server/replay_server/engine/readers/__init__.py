"""Readers: how a draw's positions become a batch (see :mod:`~replay_server.engine.readers.base`)."""

from __future__ import annotations

from replay_server.engine.readers.base import Reader, StoredRows
from replay_server.engine.readers.framestack import FrameStacks, check_stack_columns
from replay_server.engine.readers.nstep import NEXT_PREFIX, STEPS_KEY, NStepReturns

__all__ = ["NEXT_PREFIX", "STEPS_KEY", "FrameStacks", "NStepReturns", "Reader", "StoredRows",
           "check_stack_columns"]
