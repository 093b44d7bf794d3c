"""A bad config stops ``replay-server serve`` with exit code 2 and a message naming the field.

Issue 10, findings 9 and 10: ``seed = -1`` and ``server = "x"`` crashed with
a traceback (exit 1); a prioritized or slice table, or a declared schema, at
a capacity of 10**12 died in numpy or torch instead of saying the table needs
more memory than the machine has. Real processes, one per config (the
other bad values are checked in-process: tests/server/app/test_config_file.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.conftest import serve_until_exit

CASES = {
    "negative-seed": ('[[tables]]\nname = "t"\ncapacity = 10\nseed = -1\n',
                      ["table 't': seed must be an integer in [0, 2**128) or omitted, got -1"]),
    "server-not-a-table": ('server = "x"\n', ["server must be a table", "got 'x'"]),
    "declared-schema-at-1e12": (
        '[[tables]]\nname = "t"\ncapacity = 1_000_000_000_000\n[tables.schema]\n'
        'obs = "float32[4]"\n',
        ["table 't': capacity 1,000,000,000,000 (sampler state and the declared schema) needs "
         "14.6 TiB"]),
}


def test_a_bad_config_exits_2_naming_the_field(tmp_path) -> None:
    # One process per config, all at once (each exits as soon as it has read its config).
    with ThreadPoolExecutor(len(CASES)) as pool:
        runs = {case: pool.submit(serve_until_exit, tmp_path / case, text)
                for case, (text, _) in CASES.items() if not (tmp_path / case).mkdir()}
    for case, (_, fragments) in CASES.items():
        code, output = runs[case].result()
        assert code == 2, (case, output)
        heading = ("not enough memory or disk space" if case == "declared-schema-at-1e12"
                   else "configuration error")  # the machine's shortage, named as such
        assert f"replay-server: {heading}:" in output, (case, output)
        assert "Traceback" not in output, (case, output)
        for fragment in fragments:
            assert fragment in output, (case, output)
