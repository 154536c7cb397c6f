"""The `disagg` command: serve · worker · demo · check-config · report.

Parses arguments and starts things; the behaviour lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from disagg import __version__
from disagg.logs import FORMATS, configure

if TYPE_CHECKING:
    from disagg.config import ClusterConfig


def _worker(args: argparse.Namespace) -> int:
    from disagg.config import ConfigError, worker_auth_key
    from disagg.engine.checkpoint import model_from_name
    from disagg.engine.server import Worker, WorkerSettings
    from disagg.http import run, serve, server_tls

    try:
        key = worker_auth_key(args.internal_auth_key_file)
    except ConfigError as exc:
        print(f"disagg worker: {exc}", file=sys.stderr)
        return 2
    model, tokenizer = model_from_name(args.model)
    name = args.served_model_name or ("tiny" if args.model == "tiny" else args.model)
    try:
        tls = server_tls(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ValueError) as exc:
        print(f"disagg worker: cannot load --ssl-certfile / --ssl-keyfile: {exc}", file=sys.stderr)
        return 2
    scheme = "https" if tls else "http"
    advertise = args.advertise_url or f"{scheme}://{_url_host(args.host)}:{args.port}"
    settings = WorkerSettings(
        role=args.role,
        model_name=name,
        advertise_url=advertise,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        kv_lease_s=args.kv_lease,
        kv_fetch_timeout_s=args.kv_fetch_timeout,
        internal_auth_key=key,
        auth_replay_window_s=args.auth_replay_window,
        ssl_ca_file=args.ssl_ca_file,
        clock_offset_s=args.clock_offset,
    )
    worker = Worker(model, tokenizer, settings)
    logging.getLogger("disagg").info("%s worker for %s on %s", args.role, name, advertise)
    run(
        serve(
            worker.app(),
            args.host,
            args.port,
            drain=worker,
            drain_s=args.drain_timeout,
            ssl_context=tls,
        )
    )
    return 0


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _load_config(path: str) -> ClusterConfig | None:
    """The config at `path`, or None after printing the error that names the bad key."""
    from disagg.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from disagg.cache_aware import StartupError
    from disagg.http import run, serve, server_tls
    from disagg.server import Frontend

    config = _load_config(args.config)
    if config is None:
        return 2
    host = args.host or config.hostname
    port = args.port or config.port
    try:
        tls = server_tls(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        print(f"disagg serve: cannot load ssl_certfile / ssl_keyfile: {exc}", file=sys.stderr)
        return 2
    frontend = Frontend(config)
    log = logging.getLogger("disagg")
    scheme = "https" if tls else "http"
    try:
        run(
            serve(
                frontend.app(),
                host,
                port,
                ready=lambda: log.info("orchestrator listening on %s://%s:%d", scheme, host, port),
                drain=frontend,
                drain_s=config.drain_timeout,
                ssl_context=tls,
            )
        )
    except StartupError as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_config(args: argparse.Namespace) -> int:
    import yaml

    from disagg.config import config_to_dict

    config = _load_config(args.config)
    if config is None:
        return 2
    print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    print(f"# secrets: {config.secrets.describe()}")  # never the keys themselves
    return 0


def _demo(args: argparse.Namespace) -> int:
    from disagg.demo import run_demo

    return run_demo(once=args.once, prompt=args.prompt, max_tokens=args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description=__doc__)
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format", default="text", choices=list(FORMATS), help="json: one object a line"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run a reference worker")
    w.add_argument("--role", choices=["context", "generation", "mixed"], default="mixed")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face directory")
    w.add_argument("--served-model-name", default=None)
    w.add_argument(
        "--advertise-url", default=None, help="URL other workers use to fetch KV from this one"
    )
    w.add_argument("--num-blocks", type=int, default=1024)
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to finish running legs and hand over pinned KV after SIGTERM",
    )
    w.add_argument(
        "--kv-lease",
        type=float,
        default=30.0,
        help="seconds pinned context KV waits for its generation leg",
    )
    w.add_argument(
        "--kv-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds a generation worker waits for KV from a context worker"
        " (then the leg fails with code kv_transfer_failed)",
    )
    w.add_argument(
        "--internal-auth-key-file",
        default=None,
        help="file holding the cluster's internal auth key (else DISAGG_INTERNAL_AUTH_KEY):"
        " every POST to this worker must then be signed with it",
    )
    w.add_argument(
        "--auth-replay-window",
        type=float,
        default=60.0,
        help="seconds a signed request stays valid (and its nonce is remembered)",
    )
    w.add_argument("--ssl-certfile", default=None, help="serve https with this certificate")
    w.add_argument("--ssl-keyfile", default=None, help="... and this key")
    w.add_argument(
        "--ssl-ca-file", default=None, help="CA of the other workers' https URLs (KV transfer)"
    )
    w.add_argument(
        "--clock-offset",
        type=float,
        default=0.0,
        help="for tests: seconds added to the times this worker reports for its legs",
    )
    w.set_defaults(func=_worker)

    s = sub.add_parser("serve", help="run the orchestrator")
    s.add_argument("--config", required=True)
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.set_defaults(func=_serve)

    d = sub.add_parser("demo", help="orchestrator + one context and one generation worker")
    d.add_argument("--once", action="store_true", help="send one request, then exit")
    d.add_argument("--prompt", default="Tell me about disaggregated serving.")
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=_demo)

    c = sub.add_parser("check-config", help="validate a cluster file and print it resolved")
    c.add_argument("config")
    c.set_defaults(func=_check_config)

    r = sub.add_parser("report", help="chart per-request timing from /perf_metrics JSON")
    r.add_argument("perf_json", help="a saved GET /perf_metrics answer")
    r.add_argument("-o", "--output", default="report.png", help="the PNG to write")
    r.set_defaults(func=_report)
    return parser


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from disagg.report import draw, load, medians

    try:
        records = load(Path(args.perf_json))
        draw(records, Path(args.output))
    except ImportError:
        print("disagg report needs matplotlib: pip install 'disagg[plot]'", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"disagg report: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(records)} requests; median ms per span:")
    for label, ms in medians(records):
        print(f"  {label:<24}{ms:10.2f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
