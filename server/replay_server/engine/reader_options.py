"""The readers' options: n-step returns and frame stacks, declared without torch.

Each reader's spec (:mod:`replay_server.engine.options`) is here, its reader
in ``engine/readers/``: a config is read and checked (``check-config``)
without loading the readers, which need torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay_proto.scalars import is_int, is_real
from replay_server.engine.options import LayerSpec, option
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class NStepOptions(LayerSpec):
    """The n-step reader's options (:class:`NStepReturns`; ``n_step = 1``: no reader)."""

    n_step: int = option(1, "samples return n-step transitions built from each row's "
                            "episode (any sampler but fifo/lifo); 1: plain rows")
    gamma: float = option(0.99, "the discount of the n-step return, in [0, 1]")
    reward_key: str = option("reward", "the column summed into the n-step return")

    def check(self, where: str, capacity: int) -> None:
        if not is_int(self.n_step) or not 1 <= self.n_step <= min(capacity, 1000):
            raise ConfigError(f"{where}: n_step must be an integer in [1, min(capacity, 1000)] "
                              f"(1: plain rows), got {self.n_step!r}")
        if not is_real(self.gamma) or not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"{where}: gamma must be a number in [0, 1], got {self.gamma!r}")
        self._set("gamma", float(self.gamma))
        if not isinstance(self.reward_key, str) or not self.reward_key:
            raise ConfigError(f"{where}: reward_key must be a non-empty string, got "
                              f"{self.reward_key!r}")


@dataclass(frozen=True, kw_only=True)
class FrameStackOptions(LayerSpec):
    """The frame-stack reader's options (:class:`FrameStacks`; no key: no reader)."""

    frame_stack_key: str | None = option(
        None, "a stacked observation [stack, ...] stored one frame per step (with "
              "next.<key> when present), its stacks rebuilt at sample time; unset: off")
    frame_stack_fill: str = option(
        "repeat", "the frames before an episode's first step: repeat its first frame, or zero")

    def check(self, where: str, capacity: int) -> None:
        if self.frame_stack_fill not in ("repeat", "zero"):
            raise ConfigError(f"{where}: frame_stack_fill must be 'repeat' or 'zero', got "
                              f"{self.frame_stack_fill!r}")
        key = self.frame_stack_key
        if key is not None and (not isinstance(key, str) or not key or key.startswith("next.")):
            raise ConfigError(f"{where}: frame_stack_key must name the stacked observation "
                              f"(e.g. 'obs'; 'next.<key>' is stacked with it), got {key!r}")


def next_key(key: str) -> str:
    """The column of the observation after ``key``'s (``next.<key>``), stacked with it."""
    return f"next.{key}"


def storage_schema(schema: Schema, key: str) -> Schema:
    """What is stored of rows of ``schema``: the stacked keys hold one frame per row."""
    fields = dict(schema.items())
    for name in (key, next_key(key)):
        if name in fields:
            fields[name] = FieldSpec(fields[name].dtype_name, fields[name].shape[1:])
    return Schema(fields)
