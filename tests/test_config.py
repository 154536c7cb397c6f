"""Cluster file parsing: TensorRT-LLM's disagg config accepted as is, bad files named precisely."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.config import (
    ClusterConfig,
    ConditionalDisaggConfig,
    ConfigError,
    RouterConfig,
    config_to_dict,
    load_config,
    parse_config,
    static_config,
)

# Written the way TensorRT-LLM's examples/disaggregated docs show a disagg_config.yaml.
TRTLLM_EXAMPLE = """\
hostname: localhost
port: 8000
model: TinyLlama/TinyLlama-1.1B-Chat-v1.0
backend: pytorch
free_gpu_memory_fraction: 0.25
max_retries: 3
perf_metrics_max_requests: 1000
schedule_style: context_first
conditional_disagg_config:
  max_local_prefill_length: 100
otlp_config:
  otlp_traces_endpoint: "http://localhost:4317"
context_servers:
  num_instances: 2
  tensor_parallel_size: 1
  pipeline_parallel_size: 1
  max_batch_size: 8
  max_num_tokens: 4096
  max_seq_len: 4096
  enable_chunked_prefill: false
  disable_overlap_scheduler: true
  print_iter_log: true
  kv_cache_config:
    free_gpu_memory_fraction: 0.2
    enable_block_reuse: true
    tokens_per_block: 64
  cache_transceiver_config:
    backend: DEFAULT
    max_tokens_in_buffer: 4096
  router:
    type: kv_cache_aware
    use_tokens: false
  urls:
    - "localhost:8001"
    - "localhost:8002"
generation_servers:
  num_instances: 1
  tensor_parallel_size: 1
  pipeline_parallel_size: 1
  moe_expert_parallel_size: 1
  enable_attention_dp: false
  max_batch_size: 256
  cuda_graph_config:
    enable_padding: true
    batch_sizes: [1, 2, 4, 8]
  kv_cache_config:
    free_gpu_memory_fraction: 0.2
  cache_transceiver_config:
    backend: UCX
  speculative_config:
    decoding_type: MTP
    num_nextn_predict_layers: 1
  router:
    type: load_balancing
    use_tokens: true
  urls:
    - "http://localhost:8003/"
"""

MINIMAL = {
    "context_servers": {"urls": ["localhost:8001"]},
    "generation_servers": {"urls": ["localhost:8002"]},
}


def _with(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(MINIMAL))
    data.update(changes)
    return data


def test_trtllm_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "disagg_config.yaml"
    path.write_text(TRTLLM_EXAMPLE)
    cfg = load_config(path)
    assert (cfg.hostname, cfg.port, cfg.model) == (
        "localhost",
        8000,
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    )
    assert cfg.max_retries == 3 and cfg.perf_metrics_max_requests == 1000
    assert cfg.conditional_disagg == ConditionalDisaggConfig(max_local_prefill_length=100)
    assert cfg.context.role == "context" and cfg.generation.role == "generation"
    assert cfg.context.urls == ("http://localhost:8001", "http://localhost:8002")
    assert cfg.generation.urls == ("http://localhost:8003",)
    assert cfg.context.router.type == "kv_cache_aware"
    # Like TensorRT-LLM, the router sees the pool's batch limits and KV block size.
    assert dict(cfg.context.router.args) == {
        "use_tokens": False,
        "max_batch_size": 8,
        "max_num_tokens": 4096,
        "tokens_per_block": 64,
    }
    assert cfg.generation.router.type == "load_balancing"
    # Top-level worker keys are inherited by both pools; nested ones stay (frozen) mappings.
    assert cfg.context.extra["backend"] == "pytorch"
    assert cfg.generation.extra["free_gpu_memory_fraction"] == 0.25
    assert cfg.context.extra["kv_cache_config"]["tokens_per_block"] == 64
    assert cfg.generation.extra["cuda_graph_config"]["batch_sizes"] == (1, 2, 4, 8)
    with pytest.raises(TypeError):
        cfg.context.extra["backend"] = "x"  # type: ignore[index]
    # disagg's own keys take their defaults.
    assert cfg.worker_startup_timeout == 60.0 and cfg.request_timeout == 180.0
    assert cfg.max_request_body_bytes == 10 * 1024 * 1024 and cfg.max_tokens_limit == 1_000_000
    assert cfg.log_level == "info" and cfg.health_check_interval == 2.0
    hash(cfg)


def test_defaults_and_own_keys() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.hostname == "127.0.0.1" and cfg.port == 8000 and cfg.model is None
    assert cfg.context.router == RouterConfig() and cfg.conditional_disagg is None
    assert cfg.schedule_style == "context_first"
    cfg = parse_config(
        _with(
            worker_startup_timeout=0,
            health_check_interval=0.5,
            request_timeout=30,
            max_request_body_bytes=1024,
            max_tokens_limit=4096,
            log_level="DEBUG",
            router={"type": "load_balancing"},
            conditional_disagg_config={},
        )
    )
    assert cfg.worker_startup_timeout == 0.0 and cfg.health_check_interval == 0.5
    assert cfg.request_timeout == 30.0 and cfg.max_request_body_bytes == 1024
    assert cfg.max_tokens_limit == 4096 and cfg.log_level == "debug"
    # The top-level router is the default for pools that have none.
    assert cfg.context.router.type == cfg.generation.router.type == "load_balancing"
    assert cfg.conditional_disagg is None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("localhost:8001", "http://localhost:8001"),
        ("10.0.0.5:9000", "http://10.0.0.5:9000"),
        ("http://host:80/", "http://host:80"),
        ("https://Example.com:8443", "https://example.com:8443"),
        ("https://example.com", "https://example.com"),
        ("[::1]:8001", "http://[::1]:8001"),
        ("http://[fe80::1]:8001", "http://[fe80::1]:8001"),
    ],
)
def test_url_normalization(url: str, expected: str) -> None:
    assert parse_config(_with(context_servers={"urls": [url]})).context.urls == (expected,)


BAD: list[tuple[str, Any, str]] = [
    ("unknown top key", _with(prot=8000), "prot: unknown key; did you mean 'port'?"),
    ("bad port", _with(port=70000), "port: must be 1..65535"),
    ("string port", _with(port="8000"), "port: expected an integer"),
    ("bool port", _with(port=True), "port: expected an integer, got bool"),
    (
        "missing generation_servers",
        {"context_servers": MINIMAL["context_servers"]},
        "generation_servers: required section is missing",
    ),
    (
        "empty urls",
        _with(generation_servers={"urls": []}),
        "generation_servers.urls: must list at least one worker URL",
    ),
    (
        "missing urls",
        _with(context_servers={"num_instances": 1}),
        "context_servers.urls: required",
    ),
    (
        "urls not a list",
        _with(context_servers={"urls": "localhost:8001"}),
        "context_servers.urls: expected a list of URLs, got str",
    ),
    (
        "bad url",
        _with(generation_servers={"urls": ["localhost:8002", "foo"]}),
        "generation_servers.urls[1]: expected \"host:port\" or http(s)://host:port URL, got 'foo'",
    ),
    (
        "ftp url",
        _with(generation_servers={"urls": ["ftp://h:1"]}),
        "generation_servers.urls[0]: expected",
    ),
    (
        "duplicate url",
        _with(context_servers={"urls": ["h:1", "http://h:1"]}),
        "context_servers.urls[1]: duplicate worker URL",
    ),
    (
        "num_instances mismatch",
        _with(context_servers={"num_instances": 2, "urls": ["h:1"]}),
        "context_servers.num_instances: is 2 but 1 URL(s)",
    ),
    (
        "num_instances zero",
        _with(context_servers={"num_instances": 0, "urls": ["h:1"]}),
        "context_servers.num_instances: must be >= 1",
    ),
    (
        "bad router type",
        _with(context_servers={"urls": ["h:1"], "router": {"type": "fastest"}}),
        "context_servers.router.type: expected one of round_robin, load_balancing, kv_cache_aware, "
        "random, power_of_two, conversation, got 'fastest'",
    ),
    (
        "bad top router type",
        _with(router={"type": "round_robbin"}),
        "router.type: expected one of round_robin, load_balancing, kv_cache_aware, random, "
        "power_of_two, conversation, got "
        "'round_robbin'; did you mean 'round_robin'?",
    ),
    (
        "router arg typo",
        _with(generation_servers={"urls": ["h:1"], "router": {"use_token": True}}),
        "generation_servers.router.use_token: unknown router argument; did you mean 'use_tokens'?",
    ),
    (
        "pool key typo",
        _with(context_servers={"url": ["h:1"]}),
        "context_servers.url: unknown key; did you mean 'urls'?",
    ),
    (
        "conditional typo",
        _with(conditional_disagg_config={"max_local_prefill_len": 5}),
        "conditional_disagg_config.max_local_prefill_len: unknown key; "
        "did you mean 'max_local_prefill_length'?",
    ),
    (
        "inherited conflict",
        _with(backend="pytorch", context_servers={"urls": ["h:1"], "backend": "trt"}),
        "context_servers.backend: 'trt' differs from the top-level backend",
    ),
    ("negative timeout", _with(request_timeout=-1), "request_timeout: must be a finite number > 0"),
    ("zero interval", _with(health_check_interval=0), "health_check_interval: must be"),
    ("string timeout", _with(worker_startup_timeout="60"), "worker_startup_timeout: expected"),
    ("bad log level", _with(log_level="loud"), "log_level: expected one of debug"),
    ("bad schedule", _with(schedule_style="gen_first"), "schedule_style: expected one of"),
    (
        "bad transfer",
        _with(generation_first_transfer="mail"),
        "generation_first_transfer: expected one of push, pull",
    ),
    (
        "bad first token",
        _with(stream_first_token="worker"),
        "stream_first_token: expected one of context, generation",
    ),
    ("not a mapping", ["context_servers"], "expected a mapping at the top level, got list"),
    ("empty file", None, "the config file is empty"),
    ("pool not a mapping", _with(context_servers=["h:1"]), "context_servers: expected a mapping"),
]


@pytest.mark.parametrize(("data", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config(data: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert expected in str(info.value)
    assert str(info.value).startswith(info.value.path)


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        textwrap.dedent("""\
        port: 8000
        context_servers:
          urls: [localhost:8001
        generation_servers: {}
        """)
    )
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_file_must_be_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(path)


def test_config_to_dict_round_trip() -> None:
    cfg = parse_config(yaml.safe_load(TRTLLM_EXAMPLE))
    plain = config_to_dict(cfg)
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # plain YAML-able data
    assert parse_config(plain) == cfg
    for cfg in (parse_config(MINIMAL), static_config(["a:1"], ["b:2"], request_timeout=5)):
        assert parse_config(config_to_dict(cfg)) == cfg


def test_static_config_validates() -> None:
    cfg = static_config(
        ["localhost:8001"],
        ["localhost:8002", "localhost:8003"],
        port=9000,
        conditional_disagg_config={"max_local_prefill_length": 8},
    )
    assert isinstance(cfg, ClusterConfig)
    assert cfg.generation.urls == ("http://localhost:8002", "http://localhost:8003")
    assert cfg.port == 9000 and cfg.conditional_disagg == ConditionalDisaggConfig(8)
    with pytest.raises(ConfigError, match=r"generation_servers\.urls\[0\]"):
        static_config(["localhost:8001"], ["nope"])
    with pytest.raises(ConfigError, match=r"context_servers\.urls: must list"):
        static_config([], ["localhost:8002"])
    with pytest.raises(ConfigError, match="request_timout: unknown key"):
        static_config(["a:1"], ["b:2"], request_timout=5)


def test_generation_first_keys() -> None:
    cfg = parse_config(MINIMAL)
    assert (cfg.schedule_style, cfg.generation_first_transfer) == ("context_first", "push")
    cfg = parse_config(_with(schedule_style="generation_first", generation_first_transfer="pull"))
    assert (cfg.schedule_style, cfg.generation_first_transfer) == ("generation_first", "pull")
    assert parse_config(config_to_dict(cfg)) == cfg


def test_stream_first_token() -> None:
    assert parse_config(MINIMAL).stream_first_token == "context"
    cfg = parse_config(_with(stream_first_token="generation"))
    assert cfg.stream_first_token == "generation"
    assert parse_config(config_to_dict(cfg)) == cfg


def test_fault_handling_keys() -> None:
    cfg = parse_config(MINIMAL)
    assert (cfg.on_generation_failure, cfg.breaker_failures, cfg.breaker_cooldown) == (
        "retry",
        3,
        5.0,
    )
    assert (cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout) == (
        0,
        1024,
        10.0,
    )
    assert cfg.drain_timeout == 30.0
    cfg = parse_config(
        _with(
            on_generation_failure="fail",
            breaker_failures=1,
            breaker_cooldown=0.5,
            drain_timeout=0,
            max_concurrent_requests=8,
            max_queued_requests=0,
            queue_timeout=2,
        )
    )
    assert cfg.on_generation_failure == "fail" and cfg.breaker_failures == 1
    assert cfg.drain_timeout == 0.0 and cfg.max_concurrent_requests == 8
    assert parse_config(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            _with(on_generation_failure="local"),
            "on_generation_failure: expected one of retry, fail",
        ),
        (_with(breaker_failures=0), "breaker_failures: must be >= 1, got 0"),
        (_with(breaker_cooldown=0), "breaker_cooldown: "),
        (_with(max_concurrent_requests=-1), "max_concurrent_requests: must be >= 0, got -1"),
        (_with(queue_timeout="soon"), "queue_timeout: expected a number of seconds"),
    ],
)
def test_bad_fault_handling_keys(data: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert expected in str(exc.value)


def test_router_tokenizer_arg(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = parse_config(_with(router={"type": "kv_cache_aware", "tokenizer": str(tmp_path)}))
    assert cfg.context.router.args["tokenizer"] == str(tmp_path)
    with pytest.raises(ConfigError) as exc:
        parse_config(_with(router={"type": "kv_cache_aware", "tokenizer": "/nowhere"}))
    assert "router.tokenizer: expected 'tiny' or a directory with config.json" in str(exc.value)


def test_etcd_cluster_makes_urls_optional() -> None:
    cfg = parse_config(
        {
            "cluster": {
                "backend": "etcd",
                "endpoints": ["etcd://10.0.0.1:2379", "http://[::1]:2380", "etcd-2"],
                "name": "prod",
            },
            "generation_servers": {"urls": ["localhost:9000"]},  # a static member too
            "router": {"type": "kv_cache_aware"},
        }
    )
    assert cfg.cluster.backend == "etcd" and cfg.cluster.name == "prod"
    assert cfg.cluster.endpoints == ("10.0.0.1:2379", "[::1]:2380", "etcd-2:2379")
    assert cfg.context.urls == () and cfg.generation.urls == ("http://localhost:9000",)
    assert cfg.context.router.type == "kv_cache_aware"
    assert parse_config(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ({"backend": "zookeeper"}, "cluster.backend: expected one of static, etcd"),
        ({"backend": "etcd"}, "cluster.endpoints: backend etcd needs a list"),
        ({"backend": "etcd", "endpoints": []}, "cluster.endpoints: backend etcd needs a list"),
        ({"backend": "etcd", "endpoints": ["https://e:2379"]}, "cluster.endpoints[0]: expected"),
        ({"backend": "etcd", "endpoints": ["e:notaport"]}, "cluster.endpoints[0]: bad port"),
        ({"backend": "etcd", "endpoints": ["e"], "name": "a/b"}, "cluster.name: expected"),
        (
            {"backend": "etcd", "endpoints": ["e"], "nmae": "x"},
            "cluster.nmae: unknown key; did you mean 'name'?",
        ),
        ({"backend": "static", "endpoints": ["e"]}, "cluster.endpoints: is read only with"),
        ("etcd", "cluster: expected a mapping"),
    ],
)
def test_bad_cluster_block(cluster: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"cluster": cluster})
    assert str(err.value).startswith(expected), str(err.value)


def test_static_cluster_still_needs_urls() -> None:
    with pytest.raises(ConfigError, match="context_servers: required section"):
        parse_config({"cluster": {"backend": "static"}})
    with pytest.raises(ConfigError, match="disagg_cluster is not read"):
        parse_config({"disagg_cluster": {"cluster_uri": "etcd://x"}, "context_servers": {}})
