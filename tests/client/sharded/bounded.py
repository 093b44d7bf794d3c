"""``returns_within``: a call that must return (or raise) within a bound, run on a thread of its
own so that a hung call fails the test instead of hanging it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def returns_within(call: Callable[[], Any], bound: float) -> Any:
    """``call()``'s result (or its error, raised), which must come within ``bound`` s."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(bound), f"the call did not return within {bound} s"
    if "error" in box:
        raise box["error"]
    return box["value"]
