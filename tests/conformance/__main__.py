"""``python -m tests.conformance --tests DIR``: TorchRL's buffer tests, swapped, with verdicts.

Runs the test files in ``DIR`` (a copy of pytorch/rl's ``test/rb``; never
committed here) twice with the interpreter of a TorchRL virtualenv
(``--python``): once with TorchRL's own buffer classes, recording which
tests are in scope, then with the classes swapped for ``RemoteReplayBuffer``
on real server processes (run by ``--server-python``, this repository's
venv). Prints pass / fail / not applicable with a reason per test and the
totals (see :mod:`tests.conformance.report`); writes them under ``--out``.

``--site DIR`` (repeatable) adds directories to the TorchRL interpreter's
path: where pytest, grpcio and protobuf were installed for it (``make
conformance`` installs them there with ``pip --target``, so the TorchRL
virtualenv itself is never changed). The repository's ``proto``, ``feed``
and ``client`` directories go on the path too: the client runs from source.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conformance import report

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = [ROOT / "proto", ROOT / "feed", ROOT / "client", ROOT]


def _pytest(mode: str, args: argparse.Namespace, out: Path, targets: list[str]) -> Path:
    records = out / f"{mode}.jsonl"
    records.unlink(missing_ok=True)
    tests = Path(args.tests).resolve()
    path = [*(str(Path(s).resolve()) for s in args.site), *(str(d) for d in SOURCE_DIRS)]
    env = {**os.environ, "CONFORMANCE_MODE": mode, "CONFORMANCE_RECORDS": str(records),
           "CONFORMANCE_SERVER_PYTHON": args.server_python,
           "CONFORMANCE_WORKDIR": str(out / f"{mode}-servers"),
           "PYTHONPATH": os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "PYTHONDONTWRITEBYTECODE": "1", "REPLAY_SHARED_MEMORY": "0",
           "CONFORMANCE_DROP_UNKNOWN_ARGS": "1" if args.drop_unknown_args else "",
           "CONFORMANCE_TESTS_DIR": str(tests)}
    command = [args.python, "-m", "pytest", "-p", "tests.conformance.swap", "-p",
               "no:cacheprovider", "-q", "--tb=no", "-rN", "--rootdir", str(tests), *args.pytest_args]
    if (tests.parent / "conftest.py").exists():  # TorchRL's test/conftest.py (RNG hygiene)
        command += ["--confcutdir", str(tests.parent)]
    command += targets
    log = out / f"{mode}.log"
    started = time.monotonic()
    with log.open("w") as stream:
        result = subprocess.run(command, check=False, cwd=tests, env=env, stdout=stream,
                                stderr=subprocess.STDOUT)
    print(f"{mode} run: exit {result.returncode} in {time.monotonic() - started:.0f} s "
          f"(log: {log})", file=sys.stderr)
    if result.returncode not in (0, 1):
        tail = log.read_text()[-4000:]
        raise SystemExit(f"the {mode} run failed with exit code {result.returncode}:\n{tail}")
    return records


def _fingerprint(args: argparse.Namespace, targets: list[str]) -> str:
    """What the reference run depends on: the test files, the interpreter, the selection."""
    digest = hashlib.sha256()
    for path in sorted(Path(args.tests).resolve().rglob("*.py")):
        digest.update(str(path).encode())
        digest.update(path.read_bytes())
    digest.update(json.dumps([args.python, args.pytest_args, targets]).encode())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", required=True, help="directory of TorchRL's test/rb files")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of a virtualenv with torchrl (and pytest on --site)")
    parser.add_argument("--server-python", default=sys.executable,
                        help="interpreter that runs replay_server (this repository's venv)")
    parser.add_argument("--site", action="append", default=[],
                        help="directory added to the TorchRL interpreter's path (repeatable)")
    parser.add_argument("--out", default=str(ROOT / "build" / "conformance"),
                        help="where records, logs and the report go")
    parser.add_argument("--summary", action="store_true",
                        help="print the totals and failure causes, not a line per test")
    parser.add_argument("--drop-unknown-args", action="store_true",
                        help="drop TorchRL arguments RemoteReplayBuffer does not take instead "
                             "of failing the test (measures an older RemoteReplayBuffer as "
                             "issue 22 did)")
    parser.add_argument("--reuse-reference", action="store_true",
                        help="use the reference records already in --out, whatever they ran")
    parser.add_argument("files", nargs="*", help="test files or node ids (default: all of DIR)")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                        help="passed on to pytest (e.g. -k expr); must come last")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    targets = args.files or [str(Path(args.tests).resolve())]

    key = _fingerprint(args, targets)
    key_file = out / "reference.key"
    reuse = args.reuse_reference or (key_file.exists() and key_file.read_text() == key)
    if reuse and (out / "reference.jsonl").exists():
        print("reference run: reused (same test files, interpreter and selection)",
              file=sys.stderr)
        reference_records = out / "reference.jsonl"
    else:
        key_file.unlink(missing_ok=True)
        reference_records = _pytest("reference", args, out, targets)
        key_file.write_text(key)
    remote_records = _pytest("remote", args, out, targets)

    reference, remote = report.load(reference_records), report.load(remote_records)
    if args.files:  # a selection: report the tests it ran
        reference = {k: v for k, v in reference.items() if k in remote}
    found, outside = report.verdicts(reference, remote)
    text = report.render(found, outside, details=True)
    (out / "report.txt").write_text(text + "\n")
    (out / "verdicts.json").write_text(json.dumps(
        [v.__dict__ for v in found], indent=1) + "\n")
    if args.summary:
        print(report.render(found, outside, details=False))
        print("\nFailures by cause:")
        for cause, n in report.causes(found):
            print(f"  {n:4d}  {cause}")
    else:
        print(text)
    print(f"(report: {out / 'report.txt'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
