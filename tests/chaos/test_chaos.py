"""Chaos: workers killed, stopped and reset under load; nothing hangs, leaks or breaks silently."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.chaos import run_chaos


@pytest.mark.timeout(240)
def test_chaos_no_hangs_no_leaks_no_silent_breaks() -> None:
    result = asyncio.run(run_chaos(duration_s=30, concurrency=32))
    print(json.dumps(result))
    assert all(n >= 1 for n in result["faults"].values()), result["faults"]
    assert result["requests"] >= 60
    assert result["hung"] == 0
    assert result["in_flight"] == 0
    assert result["pinned"] == 0
    assert result["kv_blocks_restored"]
    assert result["non_stream_success_rate"] >= 0.99
    assert result["stream_failed_without_error_event"] == 0
