"""The `disagg check-config` command prints the resolved config or the error."""

from __future__ import annotations

import json
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


def test_report_draws_a_png(tmp_path: Path) -> None:
    record = {
        "request_id": "a",
        "context_sent_ms": 1.0,
        "context_done_ms": 20.0,
        "generation_accepted_ms": 25.0,
        "first_token_ms": 26.0,
        "last_token_ms": 80.0,
    }
    src, out = tmp_path / "perf.json", tmp_path / "r.png"
    src.write_text(json.dumps({"enabled": True, "records": [record] * 5}))
    run = [sys.executable, "-m", "disagg.cli", "report", str(src), "-o", str(out)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(
        [*run[:4], str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_json_request_log_lines(tmp_path: Path) -> None:
    """`--log-format json`: the orchestrator logs one JSON object per client request."""
    import httpx

    from disagg.demo import Processes, free_port
    from tests.conftest import wait_healthy

    procs = Processes()
    try:
        ctx, gen, port = free_port(), free_port(), free_port()
        procs.start("worker", "--role", "context", "--port", str(ctx))
        procs.start("worker", "--role", "generation", "--port", str(gen))
        for p in (ctx, gen):
            wait_healthy(f"http://127.0.0.1:{p}", procs)
        config = tmp_path / "c.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "port": port,
                    "context_servers": {"urls": [f"127.0.0.1:{ctx}"]},
                    "generation_servers": {"urls": [f"127.0.0.1:{gen}"]},
                }
            )
        )
        log = tmp_path / "orchestrator.log"
        with log.open("w") as sink:
            cmd = [sys.executable, "-m", "disagg.cli", "--log-format", "json", "serve"]
            proc = subprocess.Popen([*cmd, "--config", str(config)], stderr=sink)
            procs.procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, procs)
            body = {"model": "tiny", "prompt": "log me", "max_tokens": 2}
            r = httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": "L1"})
            assert r.status_code == 200
        procs.stop()
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        request = [x for x in lines if x["logger"] == "disagg.access"]
        assert len(request) == 1
        assert request[0]["request_id"] == "L1" and request[0]["status"] == 200
        assert request[0]["context"] == f"http://127.0.0.1:{ctx}"
    finally:
        procs.stop()
