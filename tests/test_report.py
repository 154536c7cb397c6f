"""`disagg report`: spans of a record add up to its last step, a skipped step counts 0, and
the PNG is drawn from /perf_metrics JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.report import SPANS, draw, load, medians, spans

FULL = {
    "request_id": "a",
    "context_sent_ms": 1.0,
    "context_done_ms": 50.0,
    "generation_sent_ms": 51.0,
    "generation_accepted_ms": 60.0,
    "first_token_ms": 62.0,
    "last_token_ms": 300.0,
}


def test_spans() -> None:
    assert spans(FULL) == [1.0, 49.0, 10.0, 2.0, 238.0]
    assert sum(spans(FULL)) == FULL["last_token_ms"]
    local = {"generation_accepted_ms": 40.0, "first_token_ms": 41.0, "last_token_ms": 90.0}
    assert spans(local) == [0.0, 0.0, 40.0, 1.0, 49.0]  # no context leg
    assert len(spans(FULL)) == len(SPANS)
    # The workers' own steps, when the record has them, place the span ends.
    timed = {
        **FULL,
        "context_worker_scheduled_ms": 3.0,
        "context_worker_first_token_ms": 45.0,
        "generation_worker_kv_transfer_end_ms": 58.0,
    }
    assert spans(timed) == [3.0, 42.0, 13.0, 4.0, 238.0]
    assert medians([FULL, timed])[0] == ("queue + routing", 2.0)


def test_draws_a_png(tmp_path: Path) -> None:
    records = [{**FULL, "request_id": str(i), "last_token_ms": 100.0 + i} for i in range(20)]
    src = tmp_path / "perf.json"
    src.write_text(json.dumps({"enabled": True, "records": [*records, {"request_id": "x"}]}))
    loaded = load(src)
    assert len(loaded) == 20  # incomplete records are left out
    out = tmp_path / "report.png"
    draw(loaded, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(ValueError):
        draw([], out)
