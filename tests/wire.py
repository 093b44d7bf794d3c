"""Wire messages built by hand, for tests that speak the protocol directly (a client sends an
insert through :func:`replay_proto.messages.insert_parts`, chunked where it is large)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replay_proto.codec import frame
from replay_proto.messages import insert_parts


def encode_insert(table: str, columns: Mapping[str, torch.Tensor],
                  priorities: torch.Tensor | None = None) -> bytes:
    """One ``InsertRequest`` message: header and payload joined."""
    return frame(*insert_parts(table, columns, priorities))
