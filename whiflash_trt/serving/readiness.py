"""Waiting for a server process started by a script or a test to answer its health check."""
from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def wait_until_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> str | None:
    """None once GET `url` answers 200; otherwise why not (the process exited, or `timeout_s` passed), with the tail
    of the server's `log`. The caller decides what a failure means (and stops the process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            return f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            return f"the server did not answer {url} within {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
