"""The result of a load run as a JSON-able dict — counts, errors by kind, throughput, latency
percentiles and CDFs — and the short table `disagg bench run` prints. Pure functions over
Samples; no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from disagg.loadgen.client import ERROR_KINDS, Sample

PERCENTILES = (50, 90, 99)
# Where each latency's CDF is sampled, so a result can be plotted (or compared) later
# without keeping every sample.
CDF_PERCENT = tuple(float(p) for p in np.linspace(0, 100, 201))


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / mean in ms of values in seconds; None each when there are none."""
    if not values_s:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    points = np.percentile(ms, PERCENTILES)
    out: dict[str, float | None] = {
        f"p{p}": round(float(v), 3) for p, v in zip(PERCENTILES, points, strict=True)
    }
    out["mean"] = round(float(ms.mean()), 3)
    return out


def cdf(values_s: Sequence[float]) -> list[float]:
    """The values in ms at CDF_PERCENT (empty when there are none)."""
    if not values_s:
        return []
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return [round(float(v), 3) for v in np.percentile(ms, CDF_PERCENT)]


def summarize(
    samples: Sequence[Sample], duration_s: float, config: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """The result of one run: `samples` are its counted requests; latencies and tokens are
    of the requests that succeeded; rates are per second of `duration_s`; `extra` keys are
    added before the `config` echo."""
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    itl = [gap for s in ok for gap in s.gaps]
    e2e = [s.end - s.start for s in ok]
    tokens = [s.output_tokens for s in ok]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    errors = Counter(s.error for s in samples if s.error is not None)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": {kind: errors.get(kind, 0) for kind in ERROR_KINDS},
        "error_examples": _examples(samples),
        "statuses": dict(sorted(Counter(str(s.status) for s in samples).items())),
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(ok) * per_s, 3),
        "output_tokens": sum(tokens),
        "output_tokens_per_s": round(sum(tokens) * per_s, 3),
        "output_tokens_per_request": _spread(tokens),
        "ttft_ms": distribution(ttft),
        "itl_ms": distribution(itl),
        "e2e_ms": distribution(e2e),
        "cdf": {
            "percent": list(CDF_PERCENT),
            "ttft_ms": cdf(ttft),
            "itl_ms": cdf(itl),
            "e2e_ms": cdf(e2e),
        },
        **extra,
        "config": config,
    }


def _examples(samples: Sequence[Sample]) -> dict[str, str]:
    """The first failure's detail of each kind."""
    out: dict[str, str] = {}
    for s in samples:
        if s.error is not None:
            out.setdefault(s.error, s.detail)
    return out


def _spread(values: Sequence[int]) -> dict[str, float | None]:
    if not values:
        return {"min": None, "mean": None, "max": None}
    return {"min": min(values), "mean": round(sum(values) / len(values), 3), "max": max(values)}


_COLUMNS = (
    ("run", 14),
    ("requests", 9),
    ("ok", 6),
    ("errors", 7),
    ("req/s", 9),
    ("tok/s", 10),
    ("ttft p50", 9),
    ("ttft p99", 9),
    ("itl p50", 8),
    ("itl p99", 8),
    ("e2e p50", 9),
    ("e2e p99", 9),
)


def label(config: dict[str, Any]) -> str:
    """A run's name in tables and charts, from its config: `c=8` (closed loop) or
    `rate=20/s` (open loop)."""
    if config.get("loop") == "open":
        return f"rate={config['rate']:g}/s"
    return f"c={config['concurrency']}"


def table(results: Sequence[dict[str, Any]]) -> str:
    """One row a run; latencies in ms; then each run's errors by kind, if any."""
    lines = [" ".join(f"{name:>{width}}" for name, width in _COLUMNS)]
    notes = []
    for r in results:
        cells = [
            label(r["config"]),
            r["requests"],
            r["ok"],
            r["requests"] - r["ok"],
            r["requests_per_s"],
            r["output_tokens_per_s"],
        ]
        for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
            cells += [r[metric]["p50"], r[metric]["p99"]]
        lines.append(" ".join(_cell(c, w) for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
        notes += _notes(r)
    return "\n".join(lines + notes)


def _notes(result: dict[str, Any]) -> list[str]:
    name, notes = label(result["config"]), []
    errors = ", ".join(f"{kind}={n}" for kind, n in result["errors"].items() if n)
    if errors:
        example = next(iter(result["error_examples"].values()))
        notes.append(f"{name} errors: {errors}; first: {example}")
    busy = result.get("loadgen_cpu_share", 0.0)
    if busy > 0.8 and result["duration_s"] >= 1.0:  # not for runs that failed at once
        notes.append(
            f"{name}: the load generator was busy {busy:.0%} of the run, so it may have limited"
            " the load; run it on cores the servers do not use"
        )
    return notes


def _cell(value: object, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width}.1f}"
    return f"{value!s:>{width}}"
