"""How to launch the peer orchestrators a benchmark runs beside disagg, in front of the same
workers: sglang-router and vllm-router in their PD modes, and bench/baselines' vLLM toy proxy.
It builds command lines and URLs and checks a python has the peer installed; spawning,
waiting for `ready_path`, and stopping belong to the caller.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

SGLANG_ROUTER = "sglang-router"
VLLM_ROUTER = "vllm-router"
VLLM_TOY_PROXY = "vllm-toy-proxy"

# The modules each peer imports; a python that lacks one cannot run that peer.
MODULES: dict[str, tuple[str, ...]] = {
    SGLANG_ROUTER: ("sglang_router",),
    VLLM_ROUTER: ("vllm_router",),
    VLLM_TOY_PROXY: ("fastapi", "uvicorn", "httpx"),
}
TOY_PROXY_SCRIPT = Path("bench/baselines/vllm_toy_proxy.py")  # relative to the repo root
PEERS_VENV_PYTHON = Path(".peers/bin/python")  # where bench/baselines/README.md installs them

_PROBE = (
    "import importlib.util, sys; "
    "sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)"
)


@dataclass(frozen=True)
class PeerCommand:
    name: str  # SGLANG_ROUTER, VLLM_ROUTER or VLLM_TOY_PROXY
    argv: tuple[str, ...]  # the full command to spawn
    url: str  # base URL that clients send /v1/... to
    ready_path: str  # GET path that answers 200 once the peer serves


@functools.cache
def has_modules(python: str, modules: tuple[str, ...]) -> bool:
    """Whether `python` can import every one of `modules` (asked in a subprocess)."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, *modules], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def find_python(preferred: str | None = None) -> str | None:
    """A python with at least one peer installed: `preferred` (e.g. from --peers-python) if
    given, and nothing else then; else this interpreter, else ./.peers/bin/python."""
    local = Path.cwd() / PEERS_VENV_PYTHON  # not resolved: the link is what makes it a venv
    candidates = [preferred] if preferred else [sys.executable, str(local)]
    for python in candidates:
        if any(has_modules(python, mods) for mods in MODULES.values()):
            return python
    return None


def sglang_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    port: int,
    python: str | None = None,
    *,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
) -> PeerCommand | None:
    """sglang-router's PD mode, round robin. Each prefill worker's own port is given as its
    bootstrap port, so requests carry bootstrap_host/bootstrap_port naming that worker."""
    prefill, decode = _urls(prefill, "prefill"), _urls(decode, "decode")
    py = _python_for(SGLANG_ROUTER, python)
    if py is None:
        return None
    argv = [py, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url in prefill:
        argv += ["--prefill", url, _bootstrap_port(url)]
    for url in decode:
        argv += ["--decode", url]
    argv += [*_router_common(host, port, metrics_port), "--log-level", "warn"]
    return PeerCommand(SGLANG_ROUTER, tuple(argv), _base_url(host, port), "/readiness")


def vllm_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    port: int,
    python: str | None = None,
    *,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
) -> PeerCommand | None:
    """vllm-router's PD mode (prefill leg with max_tokens=1, then decode), round robin. Its
    log level is `error`: its `warning` logs at info, and warns once per request about
    prefill answers without kv_transfer_params."""
    prefill, decode = _urls(prefill, "prefill"), _urls(decode, "decode")
    py = _python_for(VLLM_ROUTER, python)
    if py is None:
        return None
    argv = [py, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    argv += [*_router_common(host, port, metrics_port), "--log-level", "error"]
    return PeerCommand(VLLM_ROUTER, tuple(argv), _base_url(host, port), "/readiness")


def vllm_toy_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    port: int,
    python: str | None = None,
    script: Path | None = None,
    *,
    host: str = "127.0.0.1",
) -> PeerCommand | None:
    """The toy-proxy baseline; `script` defaults to the repo's copy under the working dir."""
    prefill, decode = _urls(prefill, "prefill"), _urls(decode, "decode")
    path = script if script is not None else Path.cwd() / TOY_PROXY_SCRIPT
    py = _python_for(VLLM_TOY_PROXY, python)
    if py is None or not path.is_file():
        return None
    argv = [py, str(path), "--host", host, "--port", str(port)]
    argv += ["--prefill", *prefill, "--decode", *decode]
    return PeerCommand(VLLM_TOY_PROXY, tuple(argv), _base_url(host, port), "/health")


def _python_for(peer: str, python: str | None) -> str | None:
    py = python if python is not None else find_python()
    return py if py is not None and has_modules(py, MODULES[peer]) else None


def _urls(urls: Sequence[str], role: str) -> Sequence[str]:
    if isinstance(urls, str) or not urls:
        raise ValueError(f"need a non-empty sequence of {role} URLs, got {urls!r}")
    return [u.rstrip("/") for u in urls]


def _bootstrap_port(url: str) -> str:
    port = urlsplit(url).port
    return str(port) if port is not None else "none"


def _router_common(host: str, port: int, metrics_port: int | None) -> list[str]:
    # Both routers export Prometheus metrics on a port of their own (29000 unless told), and
    # exit at start when it is taken: give each its own.
    metrics = metrics_port if metrics_port is not None else _free_port(host)
    return [
        *("--host", host, "--port", str(port), "--policy", "round_robin"),
        *("--prometheus-host", host, "--prometheus-port", str(metrics)),
    ]


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
