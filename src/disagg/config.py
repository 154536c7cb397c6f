"""The cluster file: TensorRT-LLM's `trtllm-serve disaggregated` YAML plus disagg's own keys.

Reads it once into frozen dataclasses and validates every key, naming its path in errors.
It must not start, contact or health-check workers; worker launch keys are kept only for display.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = [
    "ClusterConfig",
    "ConditionalDisaggConfig",
    "ConfigError",
    "DiscoveryConfig",
    "PoolConfig",
    "RouterConfig",
    "config_to_dict",
    "load_config",
    "parse_config",
    "static_config",
]

ROUTER_TYPES = (
    "round_robin",
    "load_balancing",
    "kv_cache_aware",
    "random",
    "power_of_two",
    "conversation",
)
SCHEDULE_STYLES = ("context_first", "generation_first")
GENERATION_FIRST_TRANSFERS = ("push", "pull")  # who moves the KV in generation_first
FIRST_TOKEN_SENDERS = ("context", "generation")  # who sends a stream's first token
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_SECTIONS = {"context": "context_servers", "generation": "generation_servers"}
_POOL_KEYS = ("num_instances", "urls", "router")
# Router arguments TensorRT-LLM's routers read, with the check each must pass.
_ROUTER_ARGS = {
    "use_tokens": "bool",
    "tokens_per_block": "positive int",
    "max_batch_size": "positive int",
    "max_num_tokens": "positive int",
    "load_weight": "number",  # kv_cache_aware: score = matched blocks - load_weight * in flight
    "max_imbalance": "positive int",  # conversation: legs beyond the least loaded before moving
    "max_conversations": "positive int",  # conversation: how many are remembered
    "tokenizer": "tokenizer",  # kv_cache_aware: "tiny" or a local Hugging Face model directory
}
# Server-section keys TensorRT-LLM copies into the router's arguments.
_ROUTER_INHERITED = ("max_batch_size", "max_num_tokens")

# Disagg-server keys of TensorRT-LLM that disagg reads.
_TRTLLM_KEYS = frozenset(
    {
        "hostname",
        "port",
        "max_retries",
        "perf_metrics_max_requests",
        "otlp_config",
        "schedule_style",
        "conditional_disagg_config",
        "router",
        "context_servers",
        "generation_servers",
    }
)
# Disagg-server keys of TensorRT-LLM that disagg accepts and ignores.
_TRTLLM_IGNORED = frozenset(
    {
        "disagg_cluster",
        "node_id",
        "return_perf_metrics",
        "perf_metrics_output_dir",
        "allow_request_chat_template",
        "gen_strip_message_history",
        "gen_tokids_ctxbytes",
        "num_workers",
        "disagg_coordinator_url",
    }
)
# Worker (LLM API / trtllm-serve) arguments. At the top level TensorRT-LLM copies them into both
# server sections, so they are accepted there; inside a section any key is accepted.
_WORKER_KEYS = frozenset(
    {
        "model",
        "backend",
        "tokenizer",
        "tokenizer_mode",
        "skip_tokenizer_init",
        "trust_remote_code",
        "dtype",
        "revision",
        "tokenizer_revision",
        "free_gpu_memory_fraction",
        "gpu_fraction",
        "kv_cache_free_gpu_memory_fraction",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "context_parallel_size",
        "moe_expert_parallel_size",
        "moe_tensor_parallel_size",
        "moe_cluster_parallel_size",
        "gpus_per_node",
        "cluster_size",
        "enable_attention_dp",
        "cp_config",
        "kv_cache_config",
        "cache_transceiver_config",
        "scheduler_config",
        "peft_cache_config",
        "lora_config",
        "enable_lora",
        "speculative_config",
        "sparse_attention_config",
        "decoding_config",
        "cuda_graph_config",
        "moe_config",
        "torch_compile_config",
        "kv_connector_config",
        "build_config",
        "quant_config",
        "calib_config",
        "max_batch_size",
        "max_num_tokens",
        "max_seq_len",
        "max_input_len",
        "max_beam_width",
        "enable_chunked_prefill",
        "disable_overlap_scheduler",
        "print_iter_log",
        "enable_iter_perf_stats",
        "enable_iter_req_stats",
        "attn_backend",
        "sampler_type",
        "load_format",
        "checkpoint_format",
        "stream_interval",
        "num_postprocess_workers",
        "postprocess_tokenizer_dir",
        "reasoning_parser",
        "guided_decoding_backend",
        "garbage_collection_gen0_threshold",
        "enable_autotuner",
        "enable_min_latency",
        "batch_wait_timeout_ms",
        "iter_stats_max_iterations",
        "request_stats_max_iterations",
        "otlp_traces_endpoint",
        "env_overrides",
        "use_cuda_graph",
        "cuda_graph_batch_sizes",
        "cuda_graph_padding_enabled",
    }
)
PREFILL_FAILURE_POLICIES = ("retry", "local", "fail")
GENERATION_FAILURE_POLICIES = ("retry", "fail")
_OWN_KEYS = frozenset(
    {
        "cluster",
        "worker_startup_timeout",
        "health_check_interval",
        "request_timeout",
        "max_request_body_bytes",
        "max_tokens_limit",
        "log_level",
        "transient_retries",
        "health_fail_threshold",
        "health_ok_threshold",
        "on_prefill_failure",
        "failure_policy_header",
        "connect_timeout",
        "context_timeout",
        "first_token_timeout",
        "stream_idle_timeout",
        "retry_interval",
        "disable_retries",
        "on_generation_failure",
        "breaker_failures",
        "breaker_cooldown",
        "drain_timeout",
        "max_concurrent_requests",
        "max_queued_requests",
        "queue_timeout",
        "kv_events_interval",
        "generation_first_transfer",
        "stream_first_token",
        "request_perf_metrics",
        # security (see `Secrets` and the limits in ClusterConfig)
        "api_keys_file",
        "admin_key_file",
        "internal_auth_key",
        "internal_request_auth_key",  # TensorRT-LLM's name for the same key
        "auth_replay_window",
        "ssl_certfile",
        "ssl_keyfile",
        "worker_ca_bundle",
        "max_prompt_tokens",
        "max_messages",
        "max_stop_sequences",
        "max_stop_length",
        "body_read_timeout",
    }
)
_TOP_KEYS = _TRTLLM_KEYS | _TRTLLM_IGNORED | _WORKER_KEYS | _OWN_KEYS


class ConfigError(Exception):
    """A bad cluster file; `path` names the offending key (e.g. `context_servers.urls[1]`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


@dataclass(frozen=True)
class RouterConfig:
    type: str = "round_robin"
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)


@dataclass(frozen=True)
class PoolConfig:
    role: str  # "context" or "generation"
    urls: tuple[str, ...]
    router: RouterConfig
    extra: Mapping[str, Any] = field(hash=False)  # accepted worker-launch keys, for display only


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where the workers come from: the static lists alone, or also etcd, where workers
    register themselves under `/disagg/<name>/workers/` (see `disagg.registry`)."""

    backend: str = "static"  # "static" | "etcd"
    endpoints: tuple[str, ...] = ()  # etcd: "host:port" each, tried in turn
    name: str = "default"  # the cluster's name: its key prefix in etcd


@dataclass(frozen=True)
class ConditionalDisaggConfig:
    max_local_prefill_length: int = 0


@dataclass(frozen=True)
class Secrets:
    """Keys, read once from their files and the environment; never printed (no repr) and not
    part of `config_to_dict`. Empty `api_keys`: clients need none. No `admin_key`: /metrics
    and /cluster_info are open. No `internal_auth_key`: legs to workers are not signed."""

    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    admin_key: str | None = field(default=None, repr=False)
    internal_auth_key: bytes | None = field(default=None, repr=False)

    def describe(self) -> str:
        return (
            f"{len(self.api_keys)} client API key(s); admin key "
            f"{'set' if self.admin_key else 'not set'}; internal auth key "
            f"{'set' if self.internal_auth_key else 'not set'}"
        )


@dataclass(frozen=True)
class ClusterConfig:
    context: PoolConfig
    generation: PoolConfig
    cluster: DiscoveryConfig = DiscoveryConfig()
    hostname: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    max_retries: int = 1
    conditional_disagg: ConditionalDisaggConfig | None = None
    schedule_style: str = "context_first"
    # generation_first: the context worker pushes the KV to the waiting generation worker, or
    # the orchestrator tells that worker where to pull it (push falls back to pull by itself).
    generation_first_transfer: str = "push"
    # A stream's first token: sent by the orchestrator from the context leg's answer at once
    # ("context"), or by the generation worker once it holds the KV ("generation").
    stream_first_token: str = "context"
    perf_metrics_max_requests: int = 0
    # Ask each worker for its timing of the leg (GET /perf_metrics then has both legs' steps).
    request_perf_metrics: bool = False
    # OpenTelemetry: where traces go over OTLP/HTTP (TensorRT-LLM's otlp_config key).
    otlp_traces_endpoint: str | None = None
    worker_startup_timeout: float = 60.0
    health_check_interval: float = 2.0
    request_timeout: float = 180.0
    max_request_body_bytes: int = 10 * 1024 * 1024
    max_tokens_limit: int = 1_000_000
    log_level: str = "info"
    transient_retries: int = 5  # extra budget for TCP resets / server disconnected
    health_fail_threshold: int = 2  # failed health checks in a row before a worker leaves
    health_ok_threshold: int = 1  # passed checks in a row before it rejoins
    on_prefill_failure: str = "retry"  # retry | local | fail
    failure_policy_header: bool = True  # clients may override it per request
    connect_timeout: float = 5.0  # s to open a connection to a worker
    context_timeout: float = 180.0  # s for one context leg attempt
    first_token_timeout: float = 180.0  # s from sending a generation leg to its first byte
    stream_idle_timeout: float = 60.0  # s without a chunk from a streaming worker
    retry_interval: float = 1.0  # seconds between attempts
    disable_retries: bool = False  # also set by DISAGG_NO_RETRY=1
    on_generation_failure: str = "retry"  # retry (a new pair) | fail
    breaker_failures: int = 3  # request-level faults in a row that open a worker's breaker
    breaker_cooldown: float = 5.0  # s an open breaker waits before one probe request
    drain_timeout: float = 30.0  # s in-flight requests may take to finish after SIGTERM
    max_concurrent_requests: int = 0  # requests served at once; 0: no limit
    max_queued_requests: int = 1024  # requests waiting for a slot; beyond that 429
    queue_timeout: float = 10.0  # s a request may wait for a slot before 429
    kv_events_interval: float = 0.1  # s between polls of the workers' KV events
    # security: where keys come from (paths only; the keys themselves are in `secrets`)
    api_keys_file: str | None = None  # one client key a line; also DISAGG_API_KEYS (a,b)
    admin_key_file: str | None = None  # guards /metrics and /cluster_info; DISAGG_ADMIN_KEY
    auth_replay_window: float = 60.0  # s a signed internal request stays valid
    ssl_certfile: str | None = None  # TLS on the frontend (with ssl_keyfile)
    ssl_keyfile: str | None = None
    worker_ca_bundle: str | None = None  # CA for https:// worker URLs (else the system's)
    # limits on a client's request (each violation a 400 naming the parameter)
    max_prompt_tokens: int = 131072
    max_messages: int = 1024
    max_stop_sequences: int = 16
    max_stop_length: int = 1024  # characters of one stop string
    body_read_timeout: float = 30.0  # s a client may take to send its body; then 408
    secrets: Secrets = field(default_factory=Secrets, compare=False, repr=False)


# --- small checkers -----------------------------------------------------------------------------


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _suggest(key: object, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_keys(data: Mapping[str, Any], known: Iterable[str], path: str) -> None:
    known = frozenset(known)
    for key in data:
        if key not in known:
            raise ConfigError(_join(path, key), f"unknown key{_suggest(key, known)}")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, got {_kind(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(_join(path, key), f"keys must be strings, got {_kind(key)}")
    return value


def _int(value: Any, path: str, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {_kind(value)} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(path, f"must be {bound}, got {value}")
    return value


def _seconds(value: Any, path: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(path, f"expected a number of seconds, got {_kind(value)} {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or math.isinf(value):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ConfigError(path, f"must be {need}, got {value}")
    return float(value)


def _choice(value: Any, path: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(choices)
        hint = _suggest(value, choices) if isinstance(value, str) else ""
        raise ConfigError(path, f"expected one of {options}, got {value!r}{hint}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, f"expected a non-empty string, got {_kind(value)} {value!r}")
    return value


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# --- URLs ---------------------------------------------------------------------------------------


def normalize_url(value: Any, path: str) -> str:
    """`host:port` or `http(s)://host[:port]` → `scheme://host[:port]` (no trailing slash)."""
    bad = f'expected "host:port" or http(s)://host:port URL, got {value!r}'
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, bad)
    text = value.strip()
    has_scheme = "://" in text
    try:
        parts = urlsplit(text if has_scheme else f"http://{text}")
        port = parts.port
    except ValueError:
        raise ConfigError(path, bad) from None
    host = parts.hostname
    if (
        parts.scheme not in ("http", "https")
        or not host
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or (port is None and not has_scheme)
        or port == 0
    ):
        raise ConfigError(path, bad)
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


# --- sections -----------------------------------------------------------------------------------


def _parse_urls(section: Mapping[str, Any], path: str, top: Mapping[str, Any]) -> tuple[str, ...]:
    """The pool's static URLs: required, unless workers come from etcd (then optional)."""
    discovered = _backend(top) == "etcd"
    if section.get("urls") is None:
        if discovered:
            return ()
        why = (
            " (TensorRT-LLM's disagg_cluster is not read: for service discovery set"
            " cluster: {backend: etcd, endpoints: [...], name: ...})"
            if "disagg_cluster" in top
            else ""
        )
        raise ConfigError(path, f"required: a non-empty list of worker URLs{why}")
    raw = section["urls"]
    if isinstance(raw, str) or not isinstance(raw, list):
        raise ConfigError(path, f"expected a list of URLs, got {_kind(raw)}")
    if not raw and not discovered:
        raise ConfigError(path, "must list at least one worker URL")
    urls = tuple(normalize_url(item, f"{path}[{i}]") for i, item in enumerate(raw))
    for i, url in enumerate(urls):
        if url in urls[:i]:
            raise ConfigError(f"{path}[{i}]", f"duplicate worker URL {url!r}")
    return urls


def _check_num_instances(section: Mapping[str, Any], count: int, path: str) -> None:
    """As in TensorRT-LLM, `num_instances` must equal the number of URLs (inferred if absent)."""
    if "num_instances" not in section:
        return
    n = _int(section["num_instances"], _join(path, "num_instances"), minimum=1)
    if n != count:
        raise ConfigError(
            _join(path, "num_instances"), f"is {n} but {count} URL(s) are listed under urls"
        )


def _check_router_arg(key: str, value: Any, path: str) -> None:
    check = _ROUTER_ARGS.get(key)
    if check == "bool" and not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {_kind(value)} {value!r}")
    if check == "positive int":
        _int(value, path, minimum=1)
    if check == "tokenizer" and not (
        value == "tiny" or (isinstance(value, str) and Path(value, "config.json").is_file())
    ):
        raise ConfigError(
            path, f"expected 'tiny' or a directory with config.json, got {_kind(value)} {value!r}"
        )
    if check == "number" and (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(path, f"expected a number >= 0, got {_kind(value)} {value!r}")


def _parse_router(block: Any, path: str, server: Mapping[str, Any]) -> RouterConfig:
    """The `router` block: a fixed `type` plus the router's own arguments."""
    data = dict(_mapping(block, path)) if block is not None else {}
    router_type = _choice(data.pop("type", "round_robin"), _join(path, "type"), ROUTER_TYPES)
    for key, value in data.items():
        known = ["type", *_ROUTER_ARGS]
        if key not in _ROUTER_ARGS and difflib.get_close_matches(key, known, cutoff=0.8):
            raise ConfigError(_join(path, key), f"unknown router argument{_suggest(key, known)}")
        _check_router_arg(key, value, _join(path, key))
    # Like TensorRT-LLM: the routers see the pool's batch limits and the KV-cache block size.
    for key in _ROUTER_INHERITED:
        if key in server:
            data[key] = server[key]
    kv_cache = server.get("kv_cache_config")
    if isinstance(kv_cache, Mapping) and "tokens_per_block" in kv_cache:
        data.setdefault("tokens_per_block", kv_cache["tokens_per_block"])
    return RouterConfig(type=router_type, args=_freeze(data))


def _check_pool_keys(section: Mapping[str, Any], path: str) -> None:
    """Any worker-launch key is accepted; one that looks like a typo of ours is not."""
    for key in section:
        if key in _POOL_KEYS or key in _WORKER_KEYS:
            continue
        if difflib.get_close_matches(key, _POOL_KEYS, n=1, cutoff=0.75):
            raise ConfigError(_join(path, key), f"unknown key{_suggest(key, _POOL_KEYS)}")


def _inherit(section: dict[str, Any], top: Mapping[str, Any], path: str) -> None:
    """Top-level worker keys apply to both pools; a differing value in a pool is an error."""
    for key in sorted(_WORKER_KEYS.intersection(top)):
        if key in section and section[key] != top[key]:
            raise ConfigError(
                _join(path, key),
                f"{section[key]!r} differs from the top-level {key}: {top[key]!r}",
            )
        section[key] = top[key]


def _parse_pool(role: str, top: Mapping[str, Any]) -> PoolConfig:
    path = _SECTIONS[role]
    if top.get(path) is None and _backend(top) != "etcd":
        raise ConfigError(path, f"required section is missing (the {role} worker pool)")
    section = dict(_mapping(top.get(path) or {}, path))
    _inherit(section, top, path)
    _check_pool_keys(section, path)
    urls = _parse_urls(section, _join(path, "urls"), top)
    _check_num_instances(section, len(urls), path)
    extra = {k: v for k, v in section.items() if k not in _POOL_KEYS}
    if section.get("router") is not None:
        router = _parse_router(section["router"], _join(path, "router"), extra)
    else:
        router = _parse_router(top.get("router"), "router", extra)
    return PoolConfig(role=role, urls=urls, router=router, extra=_freeze(extra))


DISCOVERY_BACKENDS = ("static", "etcd")
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def _backend(top: Mapping[str, Any]) -> str | None:
    block = top.get("cluster")
    return block.get("backend") if isinstance(block, Mapping) else None


def parse_etcd_endpoint(value: Any, path: str) -> str:
    """`host:port` from `etcd://host:port`, `http://host:port` or `host:port` (port 2379
    when left out). https is refused: the etcd client here speaks plain gRPC."""
    text = _str(value, path).strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "etcd", text
    if scheme not in ("etcd", "http"):
        raise ConfigError(path, f"expected etcd://host:port or http://host:port, got {text!r}")
    parts = urlsplit(f"http://{rest}")
    try:
        port = parts.port or 2379
    except ValueError:
        raise ConfigError(path, f"bad port in {text!r}") from None
    if not parts.hostname or parts.path.strip("/") or parts.query:
        raise ConfigError(path, f"expected etcd://host:port, got {text!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def _parse_cluster(value: Any) -> DiscoveryConfig:
    if value is None:
        return DiscoveryConfig()
    data = _mapping(value, "cluster")
    _check_keys(data, ("backend", "endpoints", "name"), "cluster")
    backend = _choice(data.get("backend", "static"), "cluster.backend", DISCOVERY_BACKENDS)
    if backend == "static":
        for key in ("endpoints", "name"):
            if data.get(key) is not None:
                raise ConfigError(f"cluster.{key}", "is read only with backend: etcd")
        return DiscoveryConfig()
    raw = data.get("endpoints")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ConfigError("cluster.endpoints", "backend etcd needs a list of etcd://host:port")
    endpoints = tuple(
        parse_etcd_endpoint(item, f"cluster.endpoints[{i}]") for i, item in enumerate(raw)
    )
    name = _str(data.get("name", "default"), "cluster.name")
    if not CLUSTER_NAME.fullmatch(name):
        raise ConfigError(
            "cluster.name", f"expected letters, digits, '_', '.' or '-' (1-63), got {name!r}"
        )
    return DiscoveryConfig("etcd", endpoints, name)


def _parse_conditional(value: Any, path: str) -> ConditionalDisaggConfig | None:
    if value is None:
        return None
    data = _mapping(value, path)
    if not data:
        return None
    _check_keys(data, ["max_local_prefill_length"], path)
    length = data.get("max_local_prefill_length", 0)
    return ConditionalDisaggConfig(_int(length, _join(path, "max_local_prefill_length")))


def _check_ignored(top: Mapping[str, Any]) -> None:
    """Keys disagg ignores still get the shape check TensorRT-LLM gives them."""
    for key in ("disagg_cluster",):
        if top.get(key) is not None:
            _mapping(top[key], key)
    if top.get("node_id") is not None:
        _int(top["node_id"], "node_id", maximum=255)


def _server_fields(top: Mapping[str, Any]) -> dict[str, Any]:
    """The TensorRT-LLM disagg-server keys disagg reads."""
    fields: dict[str, Any] = {}
    if "hostname" in top:
        fields["hostname"] = _str(top["hostname"], "hostname")
    if "port" in top:
        fields["port"] = _int(top["port"], "port", minimum=1, maximum=65535)
    if top.get("model") is not None:
        fields["model"] = _str(top["model"], "model")
    if "max_retries" in top:
        fields["max_retries"] = _int(top["max_retries"], "max_retries")
    if "perf_metrics_max_requests" in top:
        value = top["perf_metrics_max_requests"]
        fields["perf_metrics_max_requests"] = _int(value, "perf_metrics_max_requests")
    if top.get("schedule_style") is not None:
        fields["schedule_style"] = _choice(top["schedule_style"], "schedule_style", SCHEDULE_STYLES)
    if top.get("otlp_config") is not None:
        otlp = _mapping(top["otlp_config"], "otlp_config")
        _check_keys(otlp, frozenset({"otlp_traces_endpoint"}), "otlp_config")
        endpoint = otlp.get("otlp_traces_endpoint")
        if endpoint is not None:
            path = "otlp_config.otlp_traces_endpoint"
            endpoint = _str(endpoint, path)
            if not endpoint.startswith(("http://", "https://")):
                raise ConfigError(path, f"expected an http(s) URL, got {endpoint!r}")
            fields["otlp_traces_endpoint"] = endpoint
    fields["conditional_disagg"] = _parse_conditional(
        top.get("conditional_disagg_config"), "conditional_disagg_config"
    )
    return fields


# security keys whose values are file paths (None: unset)
_PATH_KEYS = ("api_keys_file", "admin_key_file", "ssl_certfile", "ssl_keyfile", "worker_ca_bundle")


def _security_fields(top: Mapping[str, Any]) -> dict[str, Any]:
    """Key files, TLS files and request limits. The literal internal key goes to `secrets`."""
    fields: dict[str, Any] = {}
    for key in _PATH_KEYS:
        if top.get(key) is not None:
            fields[key] = _str(top[key], key)
    if ("ssl_certfile" in fields) != ("ssl_keyfile" in fields):
        raise ConfigError("ssl_keyfile", "ssl_certfile and ssl_keyfile go together")
    if "auth_replay_window" in top:
        fields["auth_replay_window"] = _seconds(top["auth_replay_window"], "auth_replay_window")
    if "body_read_timeout" in top:
        fields["body_read_timeout"] = _seconds(top["body_read_timeout"], "body_read_timeout")
    for key in ("max_prompt_tokens", "max_messages", "max_stop_sequences", "max_stop_length"):
        if key in top:
            fields[key] = _int(top[key], key, minimum=1)
    names = [k for k in ("internal_auth_key", "internal_request_auth_key") if top.get(k)]
    if len(names) == 2:
        raise ConfigError("internal_request_auth_key", "set internal_auth_key or this, not both")
    if names:
        key = _str(top[names[0]], names[0])
        fields["secrets"] = Secrets(internal_auth_key=key.encode())
    return fields


def _own_fields(top: Mapping[str, Any]) -> dict[str, Any]:
    """disagg's own top-level keys."""
    fields: dict[str, Any] = {}
    if "worker_startup_timeout" in top:
        value = top["worker_startup_timeout"]
        fields["worker_startup_timeout"] = _seconds(
            value, "worker_startup_timeout", allow_zero=True
        )
    for key in (
        "health_check_interval",
        "request_timeout",
        "connect_timeout",
        "context_timeout",
        "first_token_timeout",
        "stream_idle_timeout",
        "breaker_cooldown",
        "queue_timeout",
        "kv_events_interval",
    ):
        if key in top:
            fields[key] = _seconds(top[key], key)
    if "drain_timeout" in top:
        fields["drain_timeout"] = _seconds(top["drain_timeout"], "drain_timeout", allow_zero=True)
    for key in ("max_request_body_bytes", "max_tokens_limit"):
        if key in top:
            fields[key] = _int(top[key], key, minimum=1)
    for key in ("max_concurrent_requests", "max_queued_requests"):
        if key in top:
            fields[key] = _int(top[key], key)
    for key in ("health_fail_threshold", "health_ok_threshold", "breaker_failures"):
        if key in top:
            fields[key] = _int(top[key], key, minimum=1)
    if "transient_retries" in top:
        fields["transient_retries"] = _int(top["transient_retries"], "transient_retries")
    if "retry_interval" in top:
        fields["retry_interval"] = _seconds(
            top["retry_interval"], "retry_interval", allow_zero=True
        )
    if "on_prefill_failure" in top:
        fields["on_prefill_failure"] = _choice(
            top["on_prefill_failure"], "on_prefill_failure", PREFILL_FAILURE_POLICIES
        )
    if "generation_first_transfer" in top:
        fields["generation_first_transfer"] = _choice(
            top["generation_first_transfer"],
            "generation_first_transfer",
            GENERATION_FIRST_TRANSFERS,
        )
    if "stream_first_token" in top:
        fields["stream_first_token"] = _choice(
            top["stream_first_token"], "stream_first_token", FIRST_TOKEN_SENDERS
        )
    if "on_generation_failure" in top:
        fields["on_generation_failure"] = _choice(
            top["on_generation_failure"], "on_generation_failure", GENERATION_FAILURE_POLICIES
        )
    if "failure_policy_header" in top:
        value = top["failure_policy_header"]
        if not isinstance(value, bool):
            raise ConfigError(
                "failure_policy_header", f"expected true or false, got {_kind(value)}"
            )
        fields["failure_policy_header"] = value
    for key in ("disable_retries", "request_perf_metrics"):
        if key in top:
            value = top[key]
            if not isinstance(value, bool):
                raise ConfigError(key, f"expected true or false, got {_kind(value)}")
            fields[key] = value
    if "log_level" in top:
        level = top["log_level"]
        fields["log_level"] = _choice(
            level.lower() if isinstance(level, str) else level, "log_level", LOG_LEVELS
        )
    return fields


# --- public API ---------------------------------------------------------------------------------


def parse_config(data: Any) -> ClusterConfig:
    """Validate an already-loaded YAML value (the whole cluster file)."""
    if data is None:
        raise ConfigError("", "the config file is empty; expected a mapping of settings")
    if not isinstance(data, Mapping):
        raise ConfigError("", f"expected a mapping at the top level, got {_kind(data)}")
    top = _mapping(data, "")
    _check_keys(top, _TOP_KEYS, "")
    _check_ignored(top)
    cluster = _parse_cluster(top.get("cluster"))  # first: it decides whether urls are needed
    return ClusterConfig(
        context=_parse_pool("context", top),
        generation=_parse_pool("generation", top),
        cluster=cluster,
        **_server_fields(top),
        **_own_fields(top),
        **_security_fields(top),
    )


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate the cluster YAML file at `path`."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError("", f"cannot read config file {os.fspath(path)!r}: {reason}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", _yaml_message(exc)) from None
    return with_environment(parse_config(data), os.environ)


def with_environment(cfg: ClusterConfig, environ: Mapping[str, str]) -> ClusterConfig:
    """Apply the environment (read here only) and read the key files: DISAGG_NO_RETRY=1 turns
    retries off; DISAGG_API_KEYS (comma-separated) adds client keys to `api_keys_file`'s;
    DISAGG_ADMIN_KEY and DISAGG_INTERNAL_AUTH_KEY override the admin and internal keys."""
    if environ.get("DISAGG_NO_RETRY", "").strip().lower() in ("1", "true", "yes"):
        cfg = dataclasses.replace(cfg, disable_retries=True)
    keys = set(_key_lines(cfg.api_keys_file, "api_keys_file"))
    keys.update(k.strip() for k in environ.get("DISAGG_API_KEYS", "").split(",") if k.strip())
    admin = environ.get("DISAGG_ADMIN_KEY", "").strip() or None
    if admin is None and cfg.admin_key_file is not None:
        lines = _key_lines(cfg.admin_key_file, "admin_key_file")
        if len(lines) != 1:
            raise ConfigError("admin_key_file", "expected exactly one key in the file")
        admin = lines[0]
    internal = environ.get("DISAGG_INTERNAL_AUTH_KEY", "").strip()
    secrets = Secrets(
        frozenset(keys),
        admin,
        internal.encode() if internal else cfg.secrets.internal_auth_key,
    )
    return dataclasses.replace(cfg, secrets=secrets)


def worker_auth_key(path: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """A reference worker's internal auth key: the one key in `path` (its
    --internal-auth-key-file), else DISAGG_INTERNAL_AUTH_KEY (of `environ`, by default the
    process's); None when neither is set: nothing is checked."""
    if path is not None:
        lines = _key_lines(path, "internal_auth_key_file")
        if len(lines) != 1:
            raise ConfigError("internal_auth_key_file", "expected exactly one key in the file")
        return lines[0].encode()
    env = os.environ if environ is None else environ
    key = env.get("DISAGG_INTERNAL_AUTH_KEY", "").strip()
    return key.encode() if key else None


def _key_lines(path: str | None, key: str) -> list[str]:
    """A key file's keys: one a line, blank lines and `#` comments skipped."""
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [line.strip() for line in fh]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path!r}: {exc}") from None
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ConfigError(key, f"{path!r} holds no key")
    return keys


def _yaml_message(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"invalid YAML: {problem}"
    return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _pool_to_dict(pool: PoolConfig) -> dict[str, Any]:
    router = {"type": pool.router.type, **_thaw(pool.router.args)}
    out: dict[str, Any] = {"urls": list(pool.urls)}
    if pool.urls:
        out = {"num_instances": len(pool.urls), **out}
    out["router"] = router
    out.update(_thaw(pool.extra))
    return out


def config_to_dict(cfg: ClusterConfig) -> dict[str, Any]:
    """The resolved config as plain data; `parse_config(config_to_dict(c)) == c`."""
    out: dict[str, Any] = {"hostname": cfg.hostname, "port": cfg.port}
    if cfg.model is not None:
        out["model"] = cfg.model
    out |= {
        "max_retries": cfg.max_retries,
        "schedule_style": cfg.schedule_style,
        "perf_metrics_max_requests": cfg.perf_metrics_max_requests,
    }
    if cfg.otlp_traces_endpoint is not None:
        out["otlp_config"] = {"otlp_traces_endpoint": cfg.otlp_traces_endpoint}
    if cfg.conditional_disagg is not None:
        limit = cfg.conditional_disagg.max_local_prefill_length
        out["conditional_disagg_config"] = {"max_local_prefill_length": limit}
    out |= {
        "worker_startup_timeout": cfg.worker_startup_timeout,
        "health_check_interval": cfg.health_check_interval,
        "request_timeout": cfg.request_timeout,
        "max_request_body_bytes": cfg.max_request_body_bytes,
        "max_tokens_limit": cfg.max_tokens_limit,
        "log_level": cfg.log_level,
        "transient_retries": cfg.transient_retries,
        "health_fail_threshold": cfg.health_fail_threshold,
        "health_ok_threshold": cfg.health_ok_threshold,
        "on_prefill_failure": cfg.on_prefill_failure,
        "failure_policy_header": cfg.failure_policy_header,
        "connect_timeout": cfg.connect_timeout,
        "context_timeout": cfg.context_timeout,
        "first_token_timeout": cfg.first_token_timeout,
        "stream_idle_timeout": cfg.stream_idle_timeout,
        "retry_interval": cfg.retry_interval,
        "disable_retries": cfg.disable_retries,
        "request_perf_metrics": cfg.request_perf_metrics,
        "on_generation_failure": cfg.on_generation_failure,
        "generation_first_transfer": cfg.generation_first_transfer,
        "stream_first_token": cfg.stream_first_token,
        "breaker_failures": cfg.breaker_failures,
        "breaker_cooldown": cfg.breaker_cooldown,
        "drain_timeout": cfg.drain_timeout,
        "max_concurrent_requests": cfg.max_concurrent_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "queue_timeout": cfg.queue_timeout,
        "kv_events_interval": cfg.kv_events_interval,
        "auth_replay_window": cfg.auth_replay_window,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_messages": cfg.max_messages,
        "max_stop_sequences": cfg.max_stop_sequences,
        "max_stop_length": cfg.max_stop_length,
        "body_read_timeout": cfg.body_read_timeout,
    }
    for key in _PATH_KEYS:
        if getattr(cfg, key) is not None:
            out[key] = getattr(cfg, key)
    if cfg.cluster.backend != "static":
        d = cfg.cluster
        out["cluster"] = {"backend": d.backend, "endpoints": list(d.endpoints), "name": d.name}
    out |= {
        "context_servers": _pool_to_dict(cfg.context),
        "generation_servers": _pool_to_dict(cfg.generation),
    }
    return out


def static_config(
    context_urls: Sequence[str], generation_urls: Sequence[str], **overrides: Any
) -> ClusterConfig:
    """A config built in code; `overrides` are top-level file keys (e.g. `request_timeout=5`)."""
    data: dict[str, Any] = dict(overrides)
    for key, urls in (("context_servers", context_urls), ("generation_servers", generation_urls)):
        section = dict(_mapping(data.get(key) or {}, key))
        section["urls"] = urls if isinstance(urls, str) else list(urls)
        data[key] = section
    return parse_config(data)
