"""How the reference worker answers the prefill/decode requests of other routers, so that a
benchmark can put them in front of it: SGLang's (`bootstrap_room` sent to both workers: a
context worker only prefills, answering after one token) and vLLM's (`kv_transfer_params`
with `do_remote_decode`: the answer carries `kv_transfer_params` for the decode leg). It
rewrites a request body and names what to add to the answer; no KV moves this way.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit


def prefill_only(body: dict[str, Any], role: str) -> None:
    """An SGLang PD request on a context worker: generate the first token only."""
    if role == "context" and body.get("bootstrap_room") is not None:
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        if "max_output_tokens" in body:
            body["max_output_tokens"] = 1


def kv_transfer_answer(body: dict[str, Any], instance: str, url: str) -> dict[str, Any]:
    """What a vLLM-style prefill answer adds for its decode leg ({} for other requests)."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return {}
    where = urlsplit(url)
    return {
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": instance,
            "remote_block_ids": [],
            "remote_host": where.hostname,
            "remote_port": where.port,
        }
    }
