"""Greedy output through disagg (context leg, KV transfer, generation leg) is token-for-token
the output of the same request on one aggregated worker."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.conftest import Cluster, assert_no_leaks


def _prompts() -> list[str]:
    rng = random.Random(7)
    words = [
        "prefill",
        "decode",
        "cache",
        "block",
        "token",
        "stream",
        "worker",
        "router",
        "model",
        "layer",
    ]
    base = "System: you are a helpful assistant that answers briefly. " * 2  # > 1 block
    prompts = ["a", "Hi", "0123456789abcde", "0123456789abcdef", "0123456789abcdefg"]
    for i in range(50):
        n = rng.randint(1, 40)
        text = " ".join(rng.choice(words) for _ in range(n))
        prompts.append(base + text if i % 3 == 0 else text)  # shared prefixes every third
    # Longer than the scheduler's 256-token step budget: prefill runs in chunks.
    prompts += [base * 6 + "chunked prefill", "long " * 130]
    return prompts


PROMPTS = _prompts()


def _complete(url: str, prompt: str, max_tokens: int) -> dict:  # type: ignore[type-arg]
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("chunk", range(5))
def test_disagg_equals_aggregated(cluster: Cluster, mixed_worker: str, chunk: int) -> None:
    for i, prompt in enumerate(PROMPTS[chunk::5]):
        max_tokens = 2 + (i * 7) % 19
        direct = _complete(mixed_worker, prompt, max_tokens)
        via = _complete(cluster.url, prompt, max_tokens)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"], prompt
        assert via["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
        assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert_no_leaks(cluster)


def test_prompt_token_ids_prompt(cluster: Cluster, mixed_worker: str) -> None:
    ids = [256, *list(b"token ids as the prompt, longer than a single block")]
    direct = _complete(mixed_worker, ids, 12)  # type: ignore[arg-type]
    via = _complete(cluster.url, ids, 12)  # type: ignore[arg-type]
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]


def test_chat_equals_aggregated(cluster: Cluster, mixed_worker: str) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Compare prefill with decode."}],
    }
    direct = httpx.post(mixed_worker + "/v1/chat/completions", json=body, timeout=60).json()
    via = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
