"""`disagg demo --once` runs the whole path and exits 0."""

from __future__ import annotations

import subprocess
import sys


def test_demo_once() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "demo", "--once"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "orchestrator ready at http://127.0.0.1:" in proc.stdout
    route = next(line for line in proc.stdout.splitlines() if line.startswith("route: "))
    assert "context=http://127.0.0.1:" in route and "generation=http://127.0.0.1:" in route
