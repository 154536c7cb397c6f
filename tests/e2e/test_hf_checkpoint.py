"""`disagg worker --model PATH`: a local Hugging Face checkpoint (config.json, safetensors,
tokenizer.json) written by the test, served disaggregated and aggregated alike."""

from __future__ import annotations

import httpx
import pytest
import yaml

from disagg.engine.checkpoint import save_checkpoint
from disagg.engine.model import Model, ModelConfig, init_weights
from tests.conftest import Procs, free_port, wait_healthy
from tests.engine.test_checkpoint import SENTENCES, _write_tokenizer

CONFIG = ModelConfig(64, 32, 64, 2, num_heads=4, num_kv_heads=2, dtype="float32", max_position=256)


@pytest.fixture(scope="module")
def hf_urls(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("hf")
    _write_tokenizer(path)
    save_checkpoint(Model(CONFIG, init_weights(CONFIG, seed=5)), path, byte_tokenizer=False)
    ports = [free_port() for _ in range(4)]
    for role, port in zip(("context", "generation", "mixed"), ports, strict=False):
        procs.start(
            "worker",
            "--role",
            role,
            "--port",
            str(port),
            "--model",
            str(path),
            "--served-model-name",
            "small",
        )
    cfg = tmp_path_factory.mktemp("hfcfg") / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "hostname": "127.0.0.1",
                "port": ports[3],
                "context_servers": {"urls": [f"127.0.0.1:{ports[0]}"]},
                "generation_servers": {"urls": [f"127.0.0.1:{ports[1]}"]},
            }
        )
    )
    procs.start("serve", "--config", str(cfg))
    orchestrator, mixed = f"http://127.0.0.1:{ports[3]}", f"http://127.0.0.1:{ports[2]}"
    wait_healthy(orchestrator, procs)
    wait_healthy(mixed, procs)
    return orchestrator, mixed


def test_hf_checkpoint_disagg_equals_aggregated(hf_urls: tuple[str, str]) -> None:
    orchestrator, mixed = hf_urls
    assert [m["id"] for m in httpx.get(orchestrator + "/v1/models").json()["data"]] == ["small"]
    for sentence in SENTENCES:
        body = {"model": "small", "prompt": sentence, "max_tokens": 8, "temperature": 0}
        via = httpx.post(orchestrator + "/v1/completions", json=body, timeout=60).json()
        direct = httpx.post(mixed + "/v1/completions", json=body, timeout=60).json()
        assert "choices" in via, via
        assert via["choices"][0]["text"] == direct["choices"][0]["text"]
        assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        assert via["usage"]["prompt_tokens"] == len(sentence.split()) + 1  # words + BOS
