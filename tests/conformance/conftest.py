"""The harness's own samples are TorchRL-style test files that the harness runs in a
subprocess (tests/conformance/test_harness.py); the suite never collects them itself."""

collect_ignore = ["samples"]
