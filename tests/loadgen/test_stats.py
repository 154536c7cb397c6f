"""The result of a load run: percentiles in ms, errors counted by kind, latencies and tokens
of the successful requests only, rates over the run's duration, and all of it JSON-able."""

from __future__ import annotations

import json

import pytest

from disagg.loadgen.client import ERROR_KINDS, Sample
from disagg.loadgen.stats import CDF_PERCENT, distribution, label, summarize, table

CONFIG = {"loop": "closed", "concurrency": 4, "target": "http://127.0.0.1:1"}


def ok(start: float, ttft: float, gaps: list[float], tokens: int) -> Sample:
    end = start + ttft + sum(gaps)
    return Sample(start, end, ttft, gaps, tokens, 200)


def failed(kind: str, status: int | None = None) -> Sample:
    return Sample(0.0, 0.5, None, [], 0, status, kind, f"{kind} happened")


def test_percentiles_in_ms() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1 .. 100 ms
    assert distribution(values) == {"p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5}
    assert distribution([0.25]) == {"p50": 250.0, "p90": 250.0, "p99": 250.0, "mean": 250.0}
    assert distribution([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_summary_counts_errors_by_kind() -> None:
    samples = [
        ok(0.0, 0.010, [0.002, 0.004], 3),
        ok(0.1, 0.030, [0.006], 2),
        failed("http_5xx", 502),
        failed("http_5xx", 503),
        failed("connect"),
        failed("stream_error", 200),
    ]
    result = summarize(samples, 2.0, CONFIG, cap_waits=1)
    assert result["requests"] == 6 and result["ok"] == 2
    assert result["errors"] == {k: 0 for k in ERROR_KINDS} | {
        "http_5xx": 2,
        "connect": 1,
        "stream_error": 1,
    }
    assert result["error_examples"]["connect"] == "connect happened"
    assert result["statuses"] == {"200": 3, "502": 1, "503": 1, "None": 1}
    assert result["requests_per_s"] == 1.0  # successful requests over 2 s
    assert result["output_tokens"] == 5 and result["output_tokens_per_s"] == 2.5
    assert result["output_tokens_per_request"] == {"min": 2, "mean": 2.5, "max": 3}
    assert result["ttft_ms"]["p50"] == 20.0  # failed requests' times are not latencies
    assert result["itl_ms"]["mean"] == 4.0
    assert result["e2e_ms"]["p50"] == pytest.approx((16 + 36) / 2)
    assert result["cap_waits"] == 1 and result["config"] == CONFIG
    assert json.loads(json.dumps(result)) == result


def test_cdf_is_sampled_at_fixed_percents() -> None:
    result = summarize([ok(0.0, i / 1000, [], 1) for i in range(1, 11)], 1.0, CONFIG)
    cdf = result["cdf"]
    assert cdf["percent"] == list(CDF_PERCENT) and len(cdf["percent"]) == 201
    assert len(cdf["ttft_ms"]) == 201 and cdf["ttft_ms"] == sorted(cdf["ttft_ms"])
    assert cdf["ttft_ms"][0] == 1.0 and cdf["ttft_ms"][-1] == 10.0
    assert cdf["itl_ms"] == []  # one chunk each: no gaps


def test_no_requests() -> None:
    result = summarize([], 0.0, CONFIG)
    assert result["requests"] == 0 and result["requests_per_s"] == 0.0
    assert result["ttft_ms"]["p99"] is None
    assert "c=4" in table([result])


def test_table_and_labels() -> None:
    result = summarize([ok(0.0, 0.01, [0.001], 2), failed("timeout")], 1.0, CONFIG)
    text = table([result])
    header, row, note = text.splitlines()
    assert header.split()[:3] == ["run", "requests", "ok"]
    assert row.split()[:4] == ["c=4", "2", "1", "1"]
    assert note == "c=4 errors: timeout=1; first: timeout happened"
    assert label({"loop": "open", "rate": 20.0, "max_in_flight": 8}) == "rate=20/s"
