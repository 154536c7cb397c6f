"""`disagg bench compare`: it starts simulated workers and the targets asked for, runs the
same load against each in alternating rounds, reports medians and ratios to disagg, skips a
peer that is not installed (saying so), and stops every process it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path


def _marked(marker: str) -> list[int]:
    """The processes whose environment carries `marker` (what the command started)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_compare_direct_and_disagg(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    marker = f"DISAGG_COMPARE_TEST={uuid.uuid4().hex}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "disagg.cli",
            "bench",
            "compare",
            "--targets",
            "direct,disagg,sglang-router",
            "--peers-python",
            sys.executable,  # the test environment has no peers
            "--concurrency",
            "1,4",
            "--rounds",
            "2",
            "--requests",
            "12",
            "--warmup",
            "2",
            "--workload",
            "fixed:in=32,out=8",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1]},
    )
    assert done.returncode == 0, done.stderr
    assert "sglang-router: not installed" in done.stderr
    result = json.loads(out.read_text())
    for level in ("1", "4"):
        rows = result["summary"][level]
        assert set(rows) == {"direct", "disagg"}
        for row in rows.values():
            assert row["errors"] == 0 and row["requests_per_s"] > 0
            assert row["ttft_p50_ms"] > 0
        assert len(result["runs"][level]["disagg"]) == 2  # one run a round
        ratios = result["ratios_to_disagg"][level]
        assert ratios["throughput_vs_direct"] > 0 and "added_ttft_p50_ms" in ratios
    assert "throughput_vs_direct" in done.stdout
    assert not _marked(marker)  # every worker and orchestrator it started is gone


def test_bad_arguments_exit_2() -> None:
    for args in (["--targets", "nope"], ["--rounds", "0"], ["--simulate", "fast"]):
        done = subprocess.run(
            [sys.executable, "-m", "disagg.cli", "bench", "compare", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2 and "disagg bench compare:" in done.stderr, args
