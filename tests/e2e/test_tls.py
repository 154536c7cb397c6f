"""TLS on the frontend: with ssl_certfile/ssl_keyfile the orchestrator serves https only; a
client that trusts the CA (the openai client included) gets answers, one that does not
fails its handshake; a bad certificate path stops the start with a clear error."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import trustme
import yaml

from disagg.demo import free_port
from tests.conftest import Procs, start_cluster, wait_healthy


def _serve_tls(procs: Procs, tmp: Path) -> tuple[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile, cafile = tmp / "cert.pem", tmp / "key.pem", tmp / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    plain = start_cluster(procs, tmp, 1, 1)  # its workers serve the TLS orchestrator too
    port = free_port()
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": plain.context_urls},
        "generation_servers": {"urls": plain.generation_urls},
        "ssl_certfile": str(certfile),
        "ssl_keyfile": str(keyfile),
    }
    path = tmp / "tls.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.start("serve", "--config", str(path))
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if (
                httpx.get(
                    url + "/health",
                    verify=ssl.create_default_context(cafile=str(cafile)),
                    timeout=2,
                ).status_code
                == 200
            ):
                return url, cafile
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the TLS orchestrator never became healthy"
        time.sleep(0.2)


def test_https_frontend(procs: Procs, tmp_path: Path) -> None:
    url, cafile = _serve_tls(procs, tmp_path)
    body = {"model": "tiny", "prompt": "over tls", "max_tokens": 3}
    r = httpx.post(
        url + "/v1/completions", json=body, verify=ssl.create_default_context(cafile=str(cafile))
    )
    assert r.status_code == 200, r.text
    client = openai.OpenAI(
        base_url=url + "/v1",
        max_retries=0,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cafile))),
    )
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.get(url + "/health")
    with pytest.raises(httpx.HTTPError):  # plain http to the TLS port
        httpx.get(url.replace("https", "http") + "/health")


def test_bad_certificate_path_is_a_clear_start_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "context_servers": {"urls": ["127.0.0.1:1"]},
                "generation_servers": {"urls": ["127.0.0.1:2"]},
                "ssl_certfile": str(tmp_path / "missing.pem"),
                "ssl_keyfile": str(tmp_path / "missing.key"),
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "cannot load ssl_certfile" in out.stderr and "Traceback" not in out.stderr


def test_https_workers_with_a_ca_bundle(procs: Procs, tmp_path: Path) -> None:
    """Workers serve https; the orchestrator trusts them by worker_ca_bundle and the
    generation worker fetches KV from the context worker over https too."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile, cafile = tmp_path / "w.pem", tmp_path / "w.key", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    tls = ["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)]
    ctx, gen, port = free_port(), free_port(), free_port()
    procs.start("worker", "--role", "context", "--port", str(ctx), *tls)
    procs.start(
        "worker", "--role", "generation", "--port", str(gen), *tls, "--ssl-ca-file", str(cafile)
    )
    verify = ssl.create_default_context(cafile=str(cafile))
    for p in (ctx, gen):
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"https://127.0.0.1:{p}/health", verify=verify).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [f"https://127.0.0.1:{ctx}"]},
        "generation_servers": {"urls": [f"https://127.0.0.1:{gen}"]},
        "worker_ca_bundle": str(cafile),
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.start("serve", "--config", str(path))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    body = {"model": "tiny", "prompt": "tls between workers", "max_tokens": 6}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    stats = httpx.get(f"https://127.0.0.1:{ctx}/stats", verify=verify).json()
    assert stats["transfers"]["fetch_served"] == 1  # the KV went over https
