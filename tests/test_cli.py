"""The `disagg check-config` command prints the resolved config or the error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disagg.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_config_prints_resolved(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "port: 8123\ncontext_servers:\n  urls: ['localhost:8001']\n"
        "generation_servers:\n  num_instances: 1\n  urls: ['localhost:8002']\n"
    )
    proc = _check(path)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["port"] == 8123
    assert resolved["generation_servers"]["urls"] == ["http://localhost:8002"]


def test_check_config_names_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "prot: 8000\ncontext_servers: {urls: ['a:1']}\ngeneration_servers: {urls: ['b:2']}\n"
    )
    proc = _check(path)
    assert proc.returncode == 2
    assert "prot" in proc.stderr and "port" in proc.stderr
    assert "Traceback" not in proc.stderr
