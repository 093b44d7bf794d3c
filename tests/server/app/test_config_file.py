"""replay_server.app.config_file: the TOML config file.

A good config loads into frozen settings; every bad value is a ConfigError whose
message names the field and the value, never a silent correction; a bad file
makes ``replay-server serve`` exit 2 with that message.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_server.engine.config import SamplerKind
from replay_server.errors import ConfigError
from replay_server.app.config_file import load_settings
from replay_server.service.settings import ServerSettings

# DESIGN.md's example, minus slice_len, which a prioritized (non-slice) table refuses.
DESIGN_EXAMPLE = """
[server]
address = "127.0.0.1:50051"
checkpoint_dir = "checkpoints"      # omitted: no persistence
checkpoint_interval_s = 600         # 0: only on request and at shutdown
metrics_address = "127.0.0.1:9100"  # Prometheus /metrics; omitted: off
pin_memory = "auto"                 # auto | true | false
auth_token_env = "REPLAY_TOKEN"     # omitted: no auth

[[tables]]
name = "replay"
capacity = 1_000_000
sampler = "prioritized"             # uniform | prioritized | slice | prioritized_slice
alpha = 0.6
beta = 0.4
min_size_to_sample = 1000
samples_per_insert = 8.0            # omitted: no ratio limit
"""

ONE_TABLE = '[[tables]]\nname = "t"\ncapacity = 10\n'


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str) -> ServerSettings:
    return load_settings(write(tmp_path, text))


def assert_config_error(tmp_path: Path, text: str, *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


# ---------------------------------------------------------------- good configs


def test_design_example_loads(tmp_path: Path) -> None:
    settings = load_text(tmp_path, DESIGN_EXAMPLE)
    assert (settings.address, settings.pin_memory, settings.auth_token_env) == (
        "127.0.0.1:50051", "auto", "REPLAY_TOKEN")
    assert (settings.checkpoint_dir, settings.checkpoint_interval_s) == ("checkpoints", 600)
    assert settings.metrics_address == "127.0.0.1:9100"
    [table] = settings.tables
    assert (table.name, table.capacity, table.sampler, table.alpha, table.beta) == (
        "replay", 1_000_000, SamplerKind.PRIORITIZED, 0.6, 0.4)
    assert (table.min_size_to_sample, table.samples_per_insert, table.error_buffer) == (
        1000, 8.0, None)
    assert table.effective_error_buffer == 8.0 * 1000


def test_flow_control_keys_load(tmp_path: Path) -> None:
    text = ONE_TABLE + ("min_size_to_sample = 5\nsamples_per_insert = 2\nerror_buffer = 20\n"
                        "max_times_sampled = 3\n")
    [table] = load_text(tmp_path, text).tables
    assert (table.min_size_to_sample, table.samples_per_insert, table.error_buffer,
            table.max_times_sampled) == (5, 2.0, 20.0, 3)


def test_bad_flow_control_value_is_refused_naming_the_table_and_key(tmp_path: Path) -> None:
    assert_config_error(tmp_path, ONE_TABLE + "min_size_to_sample = 11\n", "table 't'",
                        "min_size_to_sample", "capacity=10", "11")


def test_design_example_slice_len_loads_on_a_slice_sampler(tmp_path: Path) -> None:
    text = DESIGN_EXAMPLE.replace('"prioritized"  ', '"prioritized_slice"') + "slice_len = 32\n"
    [table] = load_text(tmp_path, text).tables
    assert (table.sampler, table.slice_len) == (SamplerKind.PRIORITIZED_SLICE, 32)


def test_omitted_server_keys_take_their_defaults(tmp_path: Path) -> None:
    settings = load_text(tmp_path, ONE_TABLE)
    assert (settings.address, settings.pin_memory, settings.auth_token_env,
            settings.max_message_mb, settings.workers, settings.log_format) == (
        "127.0.0.1:50051", "auto", None, 4, 4, "text")
    assert (settings.checkpoint_dir, settings.checkpoint_interval_s, settings.keep_latest) == (
        None, 600.0, 3)
    assert (settings.keepalive_s, settings.keepalive_timeout_s) == (30.0, 10.0)


def test_declared_schema_loads_with_nested_keys_flattened(tmp_path: Path) -> None:
    text = ONE_TABLE + ('[tables.schema]\naction = "int64[]"\n'
                        '[tables.schema.obs]\npixels = "uint8[84, 84, 4]"\n')
    [table] = load_text(tmp_path, text).tables
    assert table.schema is not None
    assert {k: (v.dtype, v.shape) for k, v in table.schema.items()} == {
        "action": (torch.int64, ()), "obs.pixels": (torch.uint8, (84, 84, 4))}


def test_settings_are_frozen(tmp_path: Path) -> None:
    settings = load_text(tmp_path, ONE_TABLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.workers = 8  # type: ignore[misc]


def test_port_zero_means_any_free_port_and_is_accepted(tmp_path: Path) -> None:
    assert load_text(tmp_path, '[server]\naddress = "127.0.0.1:0"\n' + ONE_TABLE).address == (
        "127.0.0.1:0")


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(("line", "fragments"), [
    ('address = "127.0.0.1"', ("server.address", "'127.0.0.1'")),
    ('address = "127.0.0.1:70000"', ("server.address", "'127.0.0.1:70000'")),
    ('address = ":50051"', ("server.address", "':50051'")),
    ('pin_memory = "maybe"', ("server.pin_memory", "'maybe'")),
    ("workers = 0", ("server.workers", "0")),
    ("workers = 1.5", ("server.workers", "1.5")),
    ("max_message_mb = 0", ("server.max_message_mb", "0")),
    ('log_format = "xml"', ("server.log_format", "'xml'")),
    ('auth_token_env = ""', ("server.auth_token_env", "''")),
    ('checkpoint_dir = ""', ("server.checkpoint_dir", "''")),
    ("checkpoint_dir = 3", ("server.checkpoint_dir", "3")),
    ("checkpoint_interval_s = -1", ("server.checkpoint_interval_s", "-1")),
    ("checkpoint_interval_s = inf", ("server.checkpoint_interval_s", "inf")),
    ('checkpoint_interval_s = "600"', ("server.checkpoint_interval_s", "'600'")),
    ("keep_latest = 0", ("server.keep_latest", "0")),
    ("keep_latest = 2.5", ("server.keep_latest", "2.5")),
    ("shard = 128", ("server.shard", "[0, 127]", "128")),
    ("shard = -1", ("server.shard", "-1")),
    ('start_empty_if_unrestorable = "yes"', ("server.start_empty_if_unrestorable", "'yes'")),
    ("memory_budget_mb = 0", ("server.memory_budget_mb", "0")),
    ("max_concurrent_calls = 0", ("server.max_concurrent_calls", "0")),
    ("max_connections = 1.5", ("server.max_connections", "1.5")),
    ("idle_timeout_s = 0", ("server.idle_timeout_s", "0")),
    ("idle_timeout_s = inf", ("server.idle_timeout_s", "inf")),
    ("max_batch_mb = 400", ("server.max_batch_mb", "[1, 384]", "400")),
    ("shared_memory_mb = -1", ("server.shared_memory_mb", "-1")),
    ("table_memory_mb = true", ("server.table_memory_mb", "True")),
    ("keepalive_s = 0", ("server.keepalive_s", "[1, 86400]", "0")),
    ("keepalive_s = inf", ("server.keepalive_s", "inf")),
    ("keepalive_s = true", ("server.keepalive_s", "True")),
    ("keepalive_timeout_s = 0.5", ("server.keepalive_timeout_s", "[1, 3600]", "0.5")),
    ('keepalive_timeout_s = "10"', ("server.keepalive_timeout_s", "'10'")),
    ("request_timeout_s = 0", ("server.request_timeout_s", "[0.1, 3600]", "0")),
    ("request_timeout_s = inf", ("server.request_timeout_s", "inf")),
    ("max_call_resets_per_s = 0", ("server.max_call_resets_per_s", "[1, 1e6]", "0")),
    ("max_control_bytes_per_s = 100", ("server.max_control_bytes_per_s", "[1024, 2**40]", "100")),
    ("max_control_bytes_per_s = 65536.5", ("server.max_control_bytes_per_s", "65536.5")),
    ("max_control_bytes_per_s = true", ("server.max_control_bytes_per_s", "True")),
    ("max_host_share = 0", ("server.max_host_share", "(0, 1]", "0")),
    ("max_host_share = 1.5", ("server.max_host_share", "(0, 1]", "1.5")),
    ("max_host_share = nan", ("server.max_host_share", "nan")),
    ('max_host_share = "half"', ("server.max_host_share", "'half'")),
], ids=["address-without-port", "port-70000", "address-without-host", "pin-memory-maybe",
        "workers-0", "workers-float", "max-message-0", "log-format-xml", "empty-token-env",
        "empty-checkpoint-dir", "checkpoint-dir-number", "interval-negative", "interval-inf",
        "interval-string", "keep-latest-0", "keep-latest-float", "shard-128", "shard-negative",
        "start-empty-string", "budget-0", "calls-0", "connections-float", "idle-0", "idle-inf",
        "batch-over-budget", "rings-negative", "table-memory-bool", "keepalive-0",
        "keepalive-inf", "keepalive-bool", "keepalive-timeout-half-second",
        "keepalive-timeout-string", "request-timeout-0", "request-timeout-inf", "resets-0",
        "control-bytes-100", "control-bytes-float", "control-bytes-bool", "host-share-0",
        "host-share-over-1", "host-share-nan", "host-share-string"])
def test_bad_server_value_names_the_field_and_value(
    tmp_path: Path, line: str, fragments: tuple[str, ...]
) -> None:
    assert_config_error(tmp_path, f"[server]\n{line}\n" + ONE_TABLE, *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pin_memory_true_without_cuda_is_an_error_naming_the_field(tmp_path: Path) -> None:
    assert_config_error(tmp_path, '[server]\npin_memory = "true"\n' + ONE_TABLE,
                        "server.pin_memory", "'true'", "no CUDA device")


def test_unknown_server_key_is_named(tmp_path: Path) -> None:
    assert_config_error(tmp_path, "[server]\nthreads = 4\n" + ONE_TABLE, "server", "'threads'")


def test_unknown_table_key_is_named_with_its_table(tmp_path: Path) -> None:
    assert_config_error(tmp_path, ONE_TABLE + "colour = 3\n", "tables[0]", "'t'", "'colour'")


def test_a_table_device_is_read_and_a_malformed_one_named(tmp_path: Path) -> None:
    (table,) = load_text(tmp_path, ONE_TABLE + 'device = "cuda:1"\n').tables
    assert table.device == "cuda:1" and table.on_device
    assert load_text(tmp_path, ONE_TABLE).tables[0].device == "cpu"  # the default: host memory
    assert_config_error(tmp_path, ONE_TABLE + 'device = "gpu"\n', "table 't'",
                        "device must be 'cpu', 'cuda' or 'cuda:N'", "'gpu'")


def test_unknown_section_is_named(tmp_path: Path) -> None:
    assert_config_error(tmp_path, ONE_TABLE + "[storage]\nsize = 1\n", "'storage'")


def test_duplicate_table_names_are_named(tmp_path: Path) -> None:
    assert_config_error(tmp_path, ONE_TABLE + ONE_TABLE, "unique", "'t'")


def test_an_empty_tables_array_is_an_error(tmp_path: Path) -> None:
    assert_config_error(tmp_path, "tables = []\n", "no [[tables]]")


def test_table_without_capacity_names_the_table_and_field(tmp_path: Path) -> None:
    assert_config_error(tmp_path, '[[tables]]\nname = "t"\n', "tables[0]", "'t'", "capacity")


def test_table_without_name_names_the_field(tmp_path: Path) -> None:
    assert_config_error(tmp_path, "[[tables]]\ncapacity = 10\n", "tables[0]", "name")


def test_bad_table_value_names_table_field_and_value(tmp_path: Path) -> None:
    assert_config_error(tmp_path, '[[tables]]\nname = "t"\ncapacity = -5\n',
                        "'t'", "capacity", "-5")


def test_unknown_sampler_names_the_value(tmp_path: Path) -> None:
    assert_config_error(tmp_path, ONE_TABLE + 'sampler = "heap"\n', "'t'", "sampler", "'heap'")


@pytest.mark.parametrize(("spec", "fragment"), [
    ("float32[x]", "'float32[x]'"),
    ("float32", "'float32'"),
    ("complex64[2]", "'complex64'"),
    ("float32[-1]", "'float32[-1]'"),
])
def test_bad_schema_string_names_the_key_and_value(
    tmp_path: Path, spec: str, fragment: str
) -> None:
    assert_config_error(tmp_path, ONE_TABLE + f'[tables.schema]\nobs = "{spec}"\n',
                        "tables[0]", "schema.obs", fragment)


@pytest.mark.parametrize(("schema", "fragments"), [
    ('obs = "float32[3, 0]"', ("schema.obs", "got shape [3, 0]")),
    ('obs = "uint8[1099511627776]"', ("schema.obs", "over the limit")),
    ('a = "float32[]"\n"a.b" = "float32[]"', ("key 'a' is both a value and the parent of 'a.b'",)),
], ids=["zero-size", "absurd", "colliding-keys"])
def test_bad_declared_schema_is_named(tmp_path: Path, schema: str, fragments: tuple) -> None:
    assert_config_error(tmp_path, ONE_TABLE + f"[tables.schema]\n{schema}\n", "'t'", *fragments)


@pytest.mark.parametrize("text", ['server = "x"\n', "server = 1\n", "server = []\n"])
def test_a_server_section_that_is_not_a_table_is_named(tmp_path: Path, text: str) -> None:
    assert_config_error(tmp_path, text + ONE_TABLE, "server must be a table")


@pytest.mark.parametrize("text", ['tables = ["x"]\n', "tables = [1]\n", "tables = [[]]\n"])
def test_a_table_that_is_not_a_table_is_named(tmp_path: Path, text: str) -> None:
    assert_config_error(tmp_path, text, "tables[0] must be a table")


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "slice", "prioritized_slice"])
def test_a_table_needing_more_than_the_machine_is_a_config_error_not_a_traceback(
    tmp_path: Path, sampler: str
) -> None:
    from replay_server import TableSet

    extra = "slice_len = 4\nmax_times_sampled = 0\n" if "slice" in sampler else (
        "max_times_sampled = 2\n")
    settings = load_text(tmp_path, f'[[tables]]\nname = "t"\ncapacity = 1_000_000_000_000\n'
                                   f'sampler = "{sampler}"\n{extra}')
    with pytest.raises(ConfigError, match=r"table 't': capacity 1,000,000,000,000 \(sampler "
                                          r"state\) needs .* TiB, more than this machine's memory"):
        TableSet(settings.tables)


def test_schema_that_is_not_a_table_is_an_error(tmp_path: Path) -> None:
    assert_config_error(tmp_path, ONE_TABLE + 'schema = "float32[3]"\n', "tables[0]", "schema")


def test_operations_keys_load(tmp_path: Path) -> None:
    settings = load_text(tmp_path, '[server]\nmetrics_address = "127.0.0.1:9100"\n'
                                   'health_address = "127.0.0.1:50052"\n'
                                   'tls_cert_file = "s.crt"\ntls_key_file = "s.key"\n'
                                   'tls_client_ca_file = "ca.crt"\n' + ONE_TABLE)
    assert (settings.metrics_address, settings.health_address) == (
        "127.0.0.1:9100", "127.0.0.1:50052")
    assert (settings.tls, settings.tls_cert_file, settings.tls_key_file,
            settings.tls_client_ca_file) == (True, "s.crt", "s.key", "ca.crt")


@pytest.mark.parametrize(("lines", "fragments"), [
    ('metrics_address = "9100"', ("server.metrics_address", "'9100'")),
    ('health_address = "localhost:99999"', ("server.health_address", "'localhost:99999'")),
    ('tls_cert_file = "s.crt"', ("tls_cert_file and server.tls_key_file go together",)),
    ('tls_key_file = "s.key"', ("tls_cert_file and server.tls_key_file go together",)),
    ('tls_client_ca_file = "ca.crt"', ("server.tls_client_ca_file", "needs TLS")),
    ('tls_cert_file = ""\ntls_key_file = "k"', ("server.tls_cert_file", "''")),
    ('allow_plaintext_token = "yes"', ("server.allow_plaintext_token", "'yes'")),
])
def test_bad_operations_value_names_the_key(tmp_path: Path, lines: str,
                                            fragments: tuple[str, ...]) -> None:
    assert_config_error(tmp_path, f"[server]\n{lines}\n{ONE_TABLE}", *fragments)


def test_a_token_on_a_network_address_needs_tls_or_an_explicit_allowance(tmp_path: Path) -> None:
    exposed = '[server]\naddress = "0.0.0.0:50051"\nauth_token_env = "T"\n'
    assert_config_error(tmp_path, exposed + ONE_TABLE, "server.auth_token_env", "'0.0.0.0:50051'",
                        "clear text", "server.tls_cert_file", "allow_plaintext_token = true")
    assert load_text(tmp_path, exposed + "allow_plaintext_token = true\n" + ONE_TABLE)
    assert load_text(tmp_path, exposed + 'tls_cert_file = "c"\ntls_key_file = "k"\n' + ONE_TABLE)
    for loopback in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", "127.0.0.2:1"):
        local = f'[server]\naddress = "{loopback}"\nauth_token_env = "T"\n' + ONE_TABLE
        assert load_text(tmp_path, local).address == loopback  # the token never leaves the host


# ---------------------------------------------------------------------- files


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    with pytest.raises(ConfigError, match="nowhere.toml"):
        load_settings(missing)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\naddress = ", name="broken.toml")
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        load_settings(path)


def test_value_error_from_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nworkers = 0\n' + ONE_TABLE, name="workers.toml")
    with pytest.raises(ConfigError, match=r"workers\.toml.*server\.workers"):
        load_settings(path)


def test_serve_with_a_bad_config_exits_2_printing_the_reason(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nlog_format = "xml"\n' + ONE_TABLE, name="bad.toml")
    script = Path(sys.executable).with_name("replay-server")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "replay_server.app.cli"]
    result = subprocess.run([*command, "serve", "--config", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "server.log_format" in result.stderr and "'xml'" in result.stderr, result.stderr


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    """Only the first problem was reported (issue 32, friction 7): a user fixed a config one
    run of check-config (or one failed start) at a time."""
    text = ('[server]\naddress = "x"\n[[tables]]\nname = "a"\ncapacity = -1\n'
            '[[tables]]\nname = "b"\ncapacity = 10\nsampler = "nope"\n'
            '[[tables]]\nname = "fine"\ncapacity = 10\n')
    with pytest.raises(ConfigError) as raised:
        load_text(tmp_path, text)
    message = str(raised.value)
    assert "3 problems:" in message
    assert "table 'a': capacity must be an integer" in message and "got -1" in message
    assert "table 'b': sampler must be one of" in message and "'nope'" in message
    assert "server.address must be 'host:port', got 'x'" in message
    assert "'fine'" not in message
