"""Start-up does not initialise CUDA: the server reports SERVING before any table needs the device.

On a GPU machine ``torch.cuda.is_available()`` initialises the CUDA driver
(seconds there). The server decides whether table storage may be pinned with
:func:`replay_feed.accelerator.cuda_present` (NVML, no CUDA initialisation)
and touches CUDA only when a table's storage is really pinned. Here, without
a GPU, the test stands in for that machine: ``torch.cuda.device_count()``
says one device is present, and every call that would initialise CUDA fails
the test.
"""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer
from replay_server.errors import ConfigError


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine whose NVML reports one GPU; initialising CUDA is recorded as a failure."""
    touched: list[str] = []

    def forbidden(name):
        def call(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"{name} initialises CUDA during start-up")
        return call

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("is_available", "init", "_lazy_init", "current_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, forbidden(f"torch.cuda.{name}"))
    return touched


def test_the_server_reports_serving_without_initialising_cuda(gpu_machine):
    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"}})  # the default tables
    assert settings.pinned  # "auto" resolved from NVML's answer alone
    with EmbeddedServer(settings) as server:  # returns once the server is SERVING
        client = ReplayClient(server.address)
        info = client.info()
        assert {"replay"} <= set(info) and not any(t.pinned for t in info.values())
        client.close()
    assert gpu_machine == []


def test_pin_memory_true_is_checked_without_initialising_cuda(gpu_machine, monkeypatch):
    assert settings_from_dict({"server": {"pin_memory": "true"}}).pinned
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="server.pin_memory is 'true' but no CUDA device"):
        settings_from_dict({"server": {"pin_memory": "true"}})
    assert gpu_machine == []


def test_a_device_table_is_checked_at_start_without_initialising_cuda(gpu_machine):
    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"},
                                   "tables": [{"name": "g", "capacity": 100, "device": "cuda"}]})
    with EmbeddedServer(settings) as server:  # device present per NVML; columns come later
        client = ReplayClient(server.address)
        assert client.info()["g"].size == 0 and server.tables["g"].config.device == "cuda"
        client.close()
    assert gpu_machine == []
