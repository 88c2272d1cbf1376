"""A corral server whose engine step hangs once a request arrives (for the hung-step watchdog test).

Run as a script: prints the port, then serves until the watchdog exits the process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the project first: tests/server must not shadow the `server` package
sys.path.append(str(ROOT / "tests"))  # conftest helpers

from conftest import start_server  # noqa: E402


def main() -> None:
    running, _, thread = start_server(hung_step_timeout_s=1.0, exit_on_hung_step=True)
    service = running.service

    def hang(*_: object, **__: object) -> object:
        time.sleep(3600)  # an engine step that never returns, as a wedged GPU kernel would
        raise AssertionError("unreachable")

    service.engine.runner.decode = hang  # type: ignore[attr-defined]
    print(running.base_url, flush=True)
    thread.join()


if __name__ == "__main__":
    main()
