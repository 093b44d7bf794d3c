"""``VectorWriter``: an actor's steps of a vector environment, one episode per sub-env.

Gymnasium 1.x vector environments (and envpool) step ``num_envs`` sub-envs
at once and reset a sub-env whose episode ended by themselves, in the mode
their ``metadata["autoreset_mode"]`` declares:

* ``next_step`` (Gymnasium's default): the call after a sub-env's last step
  only resets it: its action is ignored, it returns the new episode's first
  observation with reward 0, and it is no transition. The writer drops that
  sub-env's row of that call.
* ``same_step``: the step that ends an episode already returns the next
  episode's first observation; the last one is in ``info["final_obs"]``
  (where ``info["_final_obs"]`` is True). Given ``info``, the writer puts it
  in the row's ``next_obs_key``, so the transition is the one that happened.
* ``disabled``: the actor resets ended sub-envs itself
  (``envs.reset(options={"reset_mask": ended})``); every row is a transition.

In every mode each sub-env's rows carry its own episode id, a new one after
each step that ends an episode (any of ``end_keys`` True: ``terminated``,
``truncated``, ``done``), so slice and n-step tables keep each sub-env's
episodes whole and apart however the sub-envs' rows interleave (and a
sharded client keeps each on one shard).

The rows go through the client's :class:`~replay_client.writer.Writer`
(batched, sent in the background, its bounds and errors; its episode column
is the table's, where the table keeps episodes). Both clients make one with
``client.vector_writer(table, num_envs)`` or ``(table, env=envs)``
(:func:`vector_writer`). Thread-safety: one actor thread.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_client.errors import InvalidArgumentError
from replay_client.writer import Writer
from replay_proto.keys import flatten
from replay_proto.scalars import is_int

AUTORESET_MODES = ("next_step", "same_step", "disabled")
"""The autoreset modes, as this module names them (Gymnasium's ``AutoresetMode`` values
``"NextStep"``, ``"SameStep"``, ``"Disabled"`` and its member names are taken too)."""

END_KEYS = ("terminated", "truncated", "done")
"""The step's keys that end an episode where True (those present are read)."""


def normal_mode(mode: Any) -> str:
    """``mode`` (Gymnasium's ``AutoresetMode``, its value or name, or ours) as one of
    :data:`AUTORESET_MODES`.

    Raises:
        InvalidArgumentError: not an autoreset mode.
    """
    text = str(getattr(mode, "value", mode))
    name = text.replace("_", "").replace("-", "").lower()
    for known in AUTORESET_MODES:
        if name == known.replace("_", ""):
            return known
    raise InvalidArgumentError(f"autoreset_mode must be one of {', '.join(AUTORESET_MODES)} "
                               f"(or gymnasium.vector.AutoresetMode), got {mode!r}")


def _flags(value: Any, num_envs: int, key: str) -> np.ndarray:
    flags = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
    if flags.shape[:1] != (num_envs,):
        raise InvalidArgumentError(f"step[{key!r}] has shape {list(flags.shape)}; a vector "
                                   f"step's values lead with num_envs={num_envs}")
    return np.asarray(flags.reshape(num_envs, -1).any(axis=1))


class VectorWriter:
    """Appends a vector environment's steps to one table, one episode per sub-env.

    Args:
        writer: where the rows go (its episode column gets each sub-env's episode ids).
        num_envs: sub-envs per step (``None``: ``env``'s).
        env: a Gymnasium vector env: ``num_envs`` and ``autoreset_mode`` are read from it
            (``metadata["autoreset_mode"]``; Gymnasium's default ``next_step`` where it
            declares none).
        autoreset_mode: how the env resets ended sub-envs (see the module docstring);
            ``None``: ``env``'s, else ``next_step``.
        end_keys: keys of the step that end an episode where True.
        next_obs_key: where a ``same_step`` row's next observation goes (its flat key).

    Raises:
        InvalidArgumentError: no ``num_envs`` nor ``env``, or they (or the modes) disagree.
    """

    def __init__(self, writer: Writer, num_envs: int | None = None, *, env: Any = None,
                 autoreset_mode: Any = None, end_keys: tuple[str, ...] = END_KEYS,
                 next_obs_key: str = "next_obs") -> None:
        num_envs, mode = _shape_of(env, num_envs, autoreset_mode)
        self.writer = writer
        self.num_envs = num_envs
        self.autoreset_mode = mode
        self.end_keys = tuple(end_keys)
        self.next_obs_key = next_obs_key
        self._episodes = np.array([secrets.randbits(62) for _ in range(num_envs)], np.int64)
        self._resetting = np.zeros(num_envs, dtype=bool)  # next_step: the next row is a reset
        self.rows_dropped = 0
        """Reset steps left out (``next_step`` mode)."""

    @property
    def episode_ids(self) -> np.ndarray:
        """Each sub-env's current episode id (int64 ``[num_envs]``; a copy)."""
        return self._episodes.copy()

    def append(self, step: Any, info: Mapping[str, Any] | None = None) -> int:
        """Add one vector step: a mapping (or TensorDict) whose values lead with ``num_envs``.

        Args:
            step: the step's columns, e.g. ``{"obs", "action", "reward", "next_obs",
                "terminated", "truncated"}``, each ``[num_envs, ...]``.
            info: the env's ``info`` of this step (``same_step``: where the ended
                episodes' last observations are).

        Returns:
            The rows appended (``num_envs`` less the reset steps dropped).

        Raises:
            InvalidArgumentError: a value that does not lead with ``num_envs``; a
                ``same_step`` step that ended an episode, has ``next_obs_key``, and
                came without its ``info``. WriterError: as ``Writer.append``.
        """
        flat = flatten(step)
        ends = np.zeros(self.num_envs, dtype=bool)
        for key in self.end_keys:
            if key in flat:
                ends |= _flags(flat[key], self.num_envs, key)
        if self.autoreset_mode == "same_step":
            flat = self._final_obs(flat, ends, info)
        keep = ~self._resetting if self.autoreset_mode == "next_step" else np.ones_like(ends)
        for env in np.flatnonzero(keep).tolist():
            row = {key: self._item(value, env, key) for key, value in flat.items()}
            self.writer.append(row, episode=int(self._episodes[env]))
        ended = ends & keep
        for env in np.flatnonzero(ended).tolist():
            self._episodes[env] = secrets.randbits(62)
        if self.autoreset_mode == "next_step":
            self.rows_dropped += int((~keep).sum())
            self._resetting = ended
        return int(keep.sum())

    def _item(self, value: Any, env: int, key: str) -> Any:
        if getattr(value, "shape", ())[:1] != (self.num_envs,):
            raise InvalidArgumentError(
                f"step[{key!r}] has shape {list(getattr(value, 'shape', ()))}; a vector step's "
                f"values lead with num_envs={self.num_envs}")
        return value[env]

    def _final_obs(self, flat: dict[str, Any], ends: np.ndarray,
                   info: Mapping[str, Any] | None) -> dict[str, Any]:
        """``same_step``: the ended sub-envs' next observations replaced by their last ones."""
        if not ends.any() or self.next_obs_key not in flat:
            return flat
        if info is None or "final_obs" not in info:
            raise InvalidArgumentError(
                f"a same_step vector env ended an episode and returned the next episode's "
                f"first observation in {self.next_obs_key!r}: pass append(step, info) (its "
                f"'final_obs' holds the last observation), or store no {self.next_obs_key!r}")
        mask = np.asarray(info.get("_final_obs", ends), dtype=bool)
        final = info["final_obs"]
        column = flat[self.next_obs_key]
        fixed: Any = column.clone() if isinstance(column, torch.Tensor) else np.array(column)
        for env in np.flatnonzero(mask).tolist():
            last = final[env]
            fixed[env] = torch.as_tensor(np.asarray(last)) if isinstance(fixed, torch.Tensor) \
                else np.asarray(last)
        return {**flat, self.next_obs_key: fixed}

    # ------------------------------------------------------------ the writer's

    def flush(self, timeout: float | None = None) -> None:
        """Send every row appended so far and wait until stored (``Writer.flush``)."""
        self.writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the writer (``Writer.close``)."""
        self.writer.close(timeout)

    def __enter__(self) -> VectorWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.writer.__exit__(exc_type, exc, tb)


def _shape_of(env: Any, num_envs: int | None, mode: Any) -> tuple[int, str]:
    """``num_envs`` and the autoreset mode, from the arguments and ``env`` (checked to agree)."""
    if env is not None:
        envs = int(env.num_envs)
        if num_envs is not None and num_envs != envs:
            raise InvalidArgumentError(f"num_envs={num_envs} but the env has {envs} sub-envs")
        declared = getattr(env, "metadata", {}).get("autoreset_mode", "next_step")
        if mode is not None and normal_mode(mode) != normal_mode(declared):
            raise InvalidArgumentError(f"autoreset_mode={mode!r} but the env declares "
                                       f"{declared!r} (metadata['autoreset_mode'])")
        num_envs, mode = envs, declared
    if num_envs is None:
        raise InvalidArgumentError("a vector writer needs num_envs=... or env=...")
    if not is_int(num_envs) or num_envs < 1:
        raise InvalidArgumentError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    return num_envs, normal_mode("next_step" if mode is None else mode)


def vector_writer(self: Any, table: str, num_envs: int | None = None, *, env: Any = None,
                  autoreset_mode: Any = None, end_keys: tuple[str, ...] = END_KEYS,
                  next_obs_key: str = "next_obs", **options: Any) -> VectorWriter:
    """``client.vector_writer(table, num_envs)`` (a method of both clients, ``self`` the
    client): a :class:`VectorWriter` on ``table``, over the client's ``writer(table,
    **options)`` (``batch_rows``, ``max_delay_s``, ...): a vector env's steps
    (``[num_envs, ...]``), one episode per sub-env, reset steps dropped as the env's
    ``autoreset_mode`` says (``env=``: both read from the env)."""
    return VectorWriter(self.writer(table, **options), num_envs, env=env,
                        autoreset_mode=autoreset_mode, end_keys=end_keys,
                        next_obs_key=next_obs_key)
