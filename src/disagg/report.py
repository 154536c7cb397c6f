"""`disagg report perf.json -o report.png`: where the time of each request went, from the
records of `GET /perf_metrics` — stacked bars per request (queue, prefill, KV transfer,
decode) and the CDFs of time to first token and end-to-end latency — and a table of each
span's median. Spans use the workers' own steps where the records have them
(`request_perf_metrics`), else the orchestrator's. Reads a file, draws a PNG with matplotlib
(the `plot` extra); nothing else.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

# (label, where it ends: the first of these steps a record has), in ms after arrival; each
# span starts where the one before ended.
SPANS = (
    ("queue + routing", ("context_worker_scheduled_ms", "context_sent_ms")),
    ("prefill (context leg)", ("context_worker_first_token_ms", "context_done_ms")),
    ("handoff + KV transfer", ("generation_worker_kv_transfer_end_ms", "generation_accepted_ms")),
    ("to first token", ("first_token_ms",)),
    ("decode", ("last_token_ms",)),
)
COLORS = ("#9e9e9e", "#1f77b4", "#ff7f0e", "#bcbd22", "#2ca02c")


def load(path: Path) -> list[dict[str, Any]]:
    """The records of a /perf_metrics answer (or a bare list of them)."""
    data = json.loads(path.read_text())
    records = data["records"] if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected /perf_metrics JSON (an object with `records`)")
    return [r for r in records if isinstance(r, dict) and "last_token_ms" in r]


def spans(record: dict[str, Any]) -> list[float]:
    """Each span's ms; a step the request skipped (no context leg, say) gives 0."""
    out, at = [], 0.0
    for _, ends in SPANS:
        value = next((record[k] for k in ends if record.get(k) is not None), None)
        if value is None:
            out.append(0.0)
            continue
        out.append(max(0.0, float(value) - at))
        at = max(at, float(value))
    return out


def medians(records: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Each span's median ms over `records`."""
    rows = [spans(r) for r in records]
    return [(label, statistics.median(r[i] for r in rows)) for i, (label, _) in enumerate(SPANS)]


def draw(records: list[dict[str, Any]], out: Path, title: str = "disagg requests") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("no complete records to draw")
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    rows = [spans(r) for r in records]
    bottom = [0.0] * len(rows)
    xs = range(len(rows))
    for i, (label, _) in enumerate(SPANS):
        heights = [row[i] for row in rows]
        bars.bar(xs, heights, bottom=bottom, color=COLORS[i], label=label, width=0.85)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    bars.set(
        xlabel="request (in arrival order)", ylabel="ms after arrival", title="Where the time went"
    )
    bars.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(SPANS), fontsize=8)
    for key, label in (("first_token_ms", "time to first token"), ("last_token_ms", "end to end")):
        values = sorted(float(r[key]) for r in records if key in r)
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            cdf.step(values, ys, where="post", label=label)
    cdf.set(xlabel="ms", ylabel="share of requests", title="Latency CDF", ylim=(0, 1.02))
    cdf.grid(alpha=0.3)
    cdf.legend(loc="lower right")
    fig.suptitle(f"{title} ({len(records)} requests)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
