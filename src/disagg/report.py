"""`disagg report perf.json -o report.png`: where the time of each request went, from the
records of `GET /perf_metrics` — stacked bars per request (queue, prefill, KV transfer,
decode) and the CDFs of time to first token and end-to-end latency. Reads a file, draws a
PNG with matplotlib (the `plot` extra); nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# (label, from step, to step): spans of a record, in ms after arrival
SPANS = (
    ("queue + routing", None, "context_sent_ms"),
    ("prefill (context leg)", "context_sent_ms", "context_done_ms"),
    ("handoff + KV transfer", "context_done_ms", "generation_accepted_ms"),
    ("to first token", "generation_accepted_ms", "first_token_ms"),
    ("decode", "first_token_ms", "last_token_ms"),
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
    for _, _start, end in SPANS:
        value = record.get(end)
        if value is None:
            out.append(0.0)
            continue
        out.append(max(0.0, float(value) - at))
        at = float(value)
    return out


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
    for i, (label, _, _) in enumerate(SPANS):
        heights = [row[i] for row in rows]
        bars.bar(xs, heights, bottom=bottom, color=COLORS[i], label=label, width=0.85)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    bars.set(
        xlabel="request (in arrival order)", ylabel="ms after arrival", title="Where the time went"
    )
    bars.legend(loc="upper left", fontsize=8)
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
