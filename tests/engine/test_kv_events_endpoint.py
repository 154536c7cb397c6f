"""The reference worker's polled KV event feed: a cursor for increments, a snapshot on first
contact, for another instance, or when the cursor is older than the retained events."""

from __future__ import annotations

import httpx

from disagg.engine.kv_cache import block_hashes
from tests.conftest import Procs, free_port, wait_healthy


def test_cursor_increments_and_snapshots(procs: Procs) -> None:
    port = free_port()
    procs.start("worker", "--role", "mixed", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    first = httpx.post(url + "/kv_cache_events", json={"since": 0}).json()
    assert first["reset"] and first["block_size"] == 16
    assert first["events"] == [{"type": "cleared"}, {"type": "stored", "block_hashes": []}]
    prompt = "p" * 40  # with the BOS token: 41 ids, two full blocks
    r = httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
    )
    assert r.status_code == 200
    ids = [256, *prompt.encode()]  # the byte tokenizer's BOS, then bytes
    expected = block_hashes(ids, 16)
    cursor = {"since": first["last_event_id"], "instance": first["instance"]}
    step = httpx.post(url + "/kv_cache_events", json=cursor).json()
    assert not step["reset"]
    stored = [h for e in step["events"] if e["type"] == "stored" for h in e["block_hashes"]]
    assert stored[:2] == expected
    assert all(e["event_id"] > first["last_event_id"] for e in step["events"])
    # Nothing new since: an empty increment.
    again = {"since": step["last_event_id"], "instance": step["instance"]}
    assert httpx.post(url + "/kv_cache_events", json=again).json()["events"] == []
    # Another instance's cursor (this worker restarted, say): a snapshot of the cache.
    snap = httpx.post(url + "/kv_cache_events", json={**again, "instance": "old"}).json()
    assert snap["reset"] and set(expected) <= set(snap["events"][1]["block_hashes"])
