"""The `disagg` command: serve · worker · demo · check-config · report · bench.

Parses arguments and starts things; the behaviour lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from disagg import __version__
from disagg.logs import FORMATS, configure

if TYPE_CHECKING:
    from aiohttp import web

    from disagg.config import ClusterConfig
    from disagg.engine.model import Model
    from disagg.engine.server import Worker
    from disagg.engine.simulated import Timing
    from disagg.engine.tokenizer import Tokenizer


def _worker(args: argparse.Namespace) -> int:
    from disagg.config import ConfigError, normalize_url, worker_auth_key
    from disagg.engine.server import Worker, WorkerSettings
    from disagg.http import run, serve, server_tls

    try:
        key = worker_auth_key(args.internal_auth_key_file)
        timing = _sim_timing(args)
    except (ConfigError, ValueError) as exc:
        print(f"disagg worker: {exc}", file=sys.stderr)
        return 2
    model, tokenizer = _worker_model(args.model, timing)
    name = args.served_model_name or ("tiny" if args.model == "tiny" else args.model)
    try:
        tls = server_tls(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ValueError) as exc:
        print(f"disagg worker: cannot load --ssl-certfile / --ssl-keyfile: {exc}", file=sys.stderr)
        return 2
    scheme = "https" if tls else "http"
    advertise = args.advertise_url or f"{scheme}://{_url_host(args.host)}:{args.port}"
    try:  # one spelling of the URL, the one the orchestrators compare
        advertise = normalize_url(advertise, "--advertise-url")
    except ConfigError as exc:
        print(f"disagg worker: {exc}", file=sys.stderr)
        return 2
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
        timing=timing,
    )
    worker = Worker(model, tokenizer, settings)
    app = worker.app()
    listening: Callable[[], None] | None = None
    if args.register:
        try:
            listening = _register(args, worker, app)
        except (ImportError, ValueError) as exc:
            print(f"disagg worker: --register: {exc}", file=sys.stderr)
            return 2
    sim = "" if timing is None else f" (simulated: {args.simulate})"
    logging.getLogger("disagg").info("%s worker for %s on %s%s", args.role, name, advertise, sim)
    run(
        serve(
            app,
            args.host,
            args.port,
            ready=listening,
            drain=worker,
            drain_s=args.drain_timeout,
            ssl_context=tls,
        )
    )
    return 0


def _register(args: argparse.Namespace, worker: Worker, app: web.Application) -> Callable[[], None]:
    """Keep this worker's record in etcd while it runs (see `disagg.registration`); the
    returned function starts it, once the worker listens."""
    try:
        from disagg.registration import Registration
        from disagg.registry import Endpoints, WorkerRecord, parse_endpoints
    except ImportError as exc:
        raise ImportError(f"needs the etcd client ({exc}): pip install 'disagg[etcd]'") from None
    from disagg.config import CLUSTER_NAME
    from disagg.engine.server import CAPABILITIES

    if not CLUSTER_NAME.fullmatch(args.cluster):
        raise ValueError(f"--cluster: expected letters, digits, '_', '.' or '-': {args.cluster!r}")
    record = WorkerRecord(
        role=worker.settings.role,
        url=worker.settings.advertise_url,
        models=[worker.settings.model_name],
        block_size=worker.settings.block_size,
        capabilities=list(CAPABILITIES),
        instance=worker.instance,
        version=__version__,
    )
    endpoints = Endpoints(parse_endpoints(args.register))
    reg = Registration(endpoints, args.cluster, record, args.register_ttl)
    worker.drain_listeners.append(reg.mark_draining)

    async def stop(_app: web.Application) -> None:
        await reg.stop()

    app.on_cleanup.insert(0, stop)  # deregister before the engine stops
    return reg.start


# --sim-* flag -> (the Timing field it overrides, the factor from the flag's unit)
_SIM_OVERRIDES = {
    "sim_prefill_tps": ("prefill_tokens_per_s", 1.0),
    "sim_decode_step_ms": ("decode_step_s", 1e-3),
    "sim_decode_per_seq_ms": ("decode_step_per_seq_s", 1e-3),
    "sim_kv_bytes_per_token": ("kv_bytes_per_token", 1),
    "sim_kv_gbps": ("kv_bandwidth_bytes_per_s", 1e9),
    "sim_token_period": ("token_period_s", 1.0),
}


def _sim_timing(args: argparse.Namespace) -> Timing | None:
    """The `--simulate` preset with the `--sim-*` flags given applied; None without
    `--simulate`. ValueError for a flag that makes no sense with (or without) it."""
    import dataclasses

    from disagg.engine.simulated import PRESETS

    given = {}
    for flag, (field, unit) in _SIM_OVERRIDES.items():
        value = getattr(args, flag)
        if value is not None and not value >= 0:  # NaN too
            raise ValueError(f"--{flag.replace('_', '-')} must be a number >= 0")
        if value is not None:
            given[field] = value * unit
    if args.simulate is None:
        if given:
            raise ValueError("the --sim-* flags need --simulate PRESET")
        return None
    if args.model != "tiny":
        raise ValueError(f"--simulate stands in for the tiny model, not --model {args.model}")
    return dataclasses.replace(PRESETS[args.simulate], **given)


def _worker_model(name: str, timing: Timing | None) -> tuple[Model, Tokenizer]:
    """The model `--model` names, or with a timing the simulated one in its place."""
    from disagg.engine.checkpoint import model_from_name
    from disagg.engine.simulated import SimulatedModel
    from disagg.engine.tokenizer import ByteTokenizer

    if timing is None:
        return model_from_name(name)
    return SimulatedModel(timing), ByteTokenizer()


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
        "--advertise-url",
        default=None,
        help="URL the orchestrators and other workers reach this one at (what --register"
        " publishes); default http://HOST:PORT",
    )
    w.add_argument(
        "--register",
        default=None,
        metavar="etcd://HOST:PORT[,...]",
        help="register in etcd under a lease while running (needs disagg[etcd])",
    )
    w.add_argument(
        "--cluster", default="default", help="with --register: the cluster's name in etcd"
    )
    w.add_argument(
        "--register-ttl",
        type=float,
        default=10.0,
        help="with --register: seconds a killed worker stays registered (the lease TTL)",
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
    _simulation_flags(w)
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

    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
    bench = b.add_subparsers(dest="bench_command", required=True)
    br = bench.add_parser(
        "run",
        help="run load against one target, print a summary, write the result JSON",
        description="Closed-loop (--concurrency, a list is a sweep) or open-loop (--rate)"
        " load; run it in its own process, on cores the servers do not use.",
    )
    br.add_argument("--target", required=True, help="base URL, as in http://127.0.0.1:8000")
    br.add_argument(
        "--endpoint", choices=["completions", "chat", "responses"], default="completions"
    )
    br.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True, help="SSE answers"
    )
    loop = br.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency", default=None, help="closed-loop clients (default 8); 1,8,64 sweeps"
    )
    loop.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests/s")
    br.add_argument(
        "--max-in-flight", type=int, default=1024, help="open loop: at most this many at once"
    )
    stop = br.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, default=200, help="counted per run (200)")
    stop.add_argument("--duration", type=float, default=None, help="... or seconds per run")
    br.add_argument("--warmup", type=int, default=10, help="sent first, not counted (10)")
    br.add_argument(
        "--workload",
        default="fixed:in=128,out=32",
        help="fixed:in=N,out=M (fixed:in=128,out=32) | mix:long=N,short=N,long_share=F,out=M |"
        " shared-prefix:systems=K,turns=T,system_len=N,user_len=N,out=M | jsonl:PATH",
    )
    br.add_argument("--model", default="tiny")
    br.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    br.add_argument("--timeout", type=float, default=60.0, help="seconds per request (60)")
    br.add_argument("--seed", type=int, default=0)
    br.add_argument("--output", default="bench-result.json", help="the result JSON to write")
    br.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    br.add_argument("--quiet", action="store_true", help="no progress line, no summary")
    br.add_argument(
        "--progress", action="store_true", help="the progress line even when not on a terminal"
    )
    br.set_defaults(func=_bench_run)

    bc = bench.add_parser(
        "compare",
        help="the same load against disagg, a worker and the installed peers, side by side",
        description="Starts simulated workers (1 context + 1 generation, 1 mixed for"
        " `direct`) and each target over them, runs every level against every target"
        " --rounds times in alternating order, prints medians and ratios to disagg.",
    )
    bc.add_argument(
        "--targets",
        default="direct,disagg,sglang-router,vllm-router,vllm-toy-proxy",
        help="comma list; peers that are not installed are skipped",
    )
    bc.add_argument("--concurrency", default="64,256", help="closed-loop levels, comma list")
    bc.add_argument("--rounds", type=int, default=3)
    bc.add_argument("--requests", type=int, default=2000, help="per run")
    bc.add_argument("--warmup", type=int, default=50)
    bc.add_argument("--workload", default="fixed:in=128,out=32")
    bc.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    bc.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    bc.add_argument("--simulate", default="zero", help="the workers' --simulate preset")
    bc.add_argument(
        "--peers-python", default=None, help="a python with the peers installed (else this one)"
    )
    bc.add_argument("--output", default="bench-compare.json")
    bc.set_defaults(func=_bench_compare)
    return parser


def _simulation_flags(w: argparse.ArgumentParser) -> None:
    from disagg.engine.simulated import PRESETS

    sim = w.add_argument_group(
        "simulation",
        "a timing model in place of the model math (the rest is the real worker);"
        " each --sim-* flag overrides that figure of the preset",
    )
    sim.add_argument(
        "--simulate",
        metavar="PRESET",
        choices=list(PRESETS),
        default=None,
        help="zero: no delays at all; gpu: one H100 serving an 8B model; slow: one token/s",
    )
    flag = sim.add_argument
    flag("--sim-prefill-tps", type=float, metavar="TPS", help="prefill tokens/s (0: instant)")
    flag("--sim-decode-step-ms", type=float, metavar="MS", help="ms of one decode step")
    flag("--sim-decode-per-seq-ms", type=float, metavar="MS", help="ms more per sequence")
    flag("--sim-kv-bytes-per-token", type=int, metavar="BYTES", help="KV size of a token")
    flag("--sim-kv-gbps", type=float, metavar="GBPS", help="KV transfer GB/s (0: instant)")
    flag("--sim-token-period", type=float, metavar="S", help="s between steps, at least")


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


def _bench_run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from disagg import loadgen
    from disagg.loadgen import plots
    from disagg.loadgen.progress import progress_stream
    from disagg.loadgen.stats import table

    output, plot_dir = Path(args.output), Path(args.plot) if args.plot else None
    try:
        levels = loadgen.parse_concurrency(args.concurrency or "8")
        arrivals: loadgen.Arrivals = (
            loadgen.ClosedLoop(levels[0])
            if args.rate is None
            else loadgen.OpenLoop(args.rate, args.max_in_flight)
        )
        spec = loadgen.LoadSpec(
            workload=loadgen.parse_workload(args.workload),
            endpoint=args.endpoint,
            stream=args.stream,
            arrivals=arrivals,
            requests=args.requests if args.duration is None else None,
            duration_s=args.duration,
            warmup=args.warmup,
            model=args.model,
            api_key=args.api_key,
            timeout_s=args.timeout,
            seed=args.seed,
        )
        target = loadgen.base_url(args.target)
        if not output.parent.is_dir():
            raise ValueError(f"--output: {output.parent} is not a directory")
        if plot_dir is not None:
            plots.require()
            plot_dir.mkdir(parents=True, exist_ok=True)
    except ImportError:
        print(
            "disagg bench run --plot needs matplotlib: pip install 'disagg[plot]'", file=sys.stderr
        )
        return 2
    except (ValueError, OSError) as exc:  # a WorkloadError is a ValueError
        print(f"disagg bench run: {exc}", file=sys.stderr)
        return 2
    specs = [spec] if args.rate is not None else loadgen.concurrency_sweep(spec, levels)
    shown = None if args.quiet else progress_stream(sys.stderr, force=args.progress)
    try:
        results = loadgen.run_sweep(target, specs, progress=shown)
    except KeyboardInterrupt:
        print("disagg bench run: interrupted; no result written", file=sys.stderr)
        return 130
    result = results[0] if len(results) == 1 else {"runs": results}
    output.write_text(json.dumps(result, indent=2) + "\n")
    charts = plots.draw(results, plot_dir) if plot_dir is not None else []
    if not args.quiet:
        print(table(results))
        print("wrote " + ", ".join(str(path) for path in [output, *charts]))
    return 0


def _bench_compare(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from disagg import loadgen
    from disagg.engine.simulated import PRESETS
    from disagg.loadgen import compare

    try:
        targets = tuple(t for t in args.targets.split(",") if t)
        unknown = set(targets) - set(compare.TARGETS)
        if unknown or not targets:
            raise ValueError(f"--targets: choose from {', '.join(compare.TARGETS)}")
        spec = compare.CompareSpec(
            targets=targets,
            concurrency=tuple(loadgen.parse_concurrency(args.concurrency)),
            rounds=args.rounds,
            load=loadgen.LoadSpec(
                workload=loadgen.parse_workload(args.workload),
                endpoint=args.endpoint,
                stream=args.stream,
                requests=args.requests,
                warmup=args.warmup,
            ),
            simulate=args.simulate,
            peers_python=args.peers_python,
        )
        if args.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        if args.simulate not in PRESETS:
            raise ValueError(f"--simulate: choose from {', '.join(PRESETS)}")
    except ValueError as exc:
        print(f"disagg bench compare: {exc}", file=sys.stderr)
        return 2
    result = compare.compare(spec, say=lambda line: print(line, file=sys.stderr))
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(compare.table(result))
    print(f"wrote {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
