"""TorchRL's replay-buffer API over a replay server's tables (``RemoteReplayBuffer``).

Modules: :mod:`~replay_client.torchrl.components` reads TorchRL's storage,
sampler and writer objects into the table they need.
"""
