"""The TorchRL conformance harness: TorchRL's own replay-buffer tests, run with the buffer
classes swapped for ``RemoteReplayBuffer`` on real servers (``make conformance``;
``docs/torchrl.md`` has the table). TorchRL's test files are never part of this
repository: point the harness at a copy (``python -m tests.conformance --help``)."""
