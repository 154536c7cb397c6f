"""`disagg report`: spans of a record add up to its last step, a skipped step counts 0, and
the PNG is drawn from /perf_metrics JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.report import SPANS, draw, load, spans

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
