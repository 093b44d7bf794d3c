"""TorchRL's replay-buffer API over a replay server's tables: :class:`RemoteReplayBuffer`.

Modules, one concept each: :mod:`~replay_client.torchrl.buffer` (the buffer),
:mod:`~replay_client.torchrl.components` (TorchRL's storage, sampler and writer
objects read into the table they need), :mod:`~replay_client.torchrl.slices`
(batch sizes in steps, flat slice batches with TorchRL's markers),
:mod:`~replay_client.torchrl.episodes` (episode ids from trajectory data),
:mod:`~replay_client.torchrl.positions` (storage positions and ids),
:mod:`~replay_client.torchrl.indexing` (``rb[index]``, writes by position),
:mod:`~replay_client.torchrl.state` (state dicts and dumps),
:mod:`~replay_client.torchrl.sampler_view` (``rb.sampler.beta``) and
:mod:`~replay_client.torchrl.data_kinds` (tensors and tensorclasses in and out).
"""

from replay_client.torchrl.buffer import RemoteReplayBuffer

__all__ = ["RemoteReplayBuffer"]
