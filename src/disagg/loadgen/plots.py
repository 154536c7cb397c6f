"""Charts of `disagg bench run --plot DIR`: the latency CDFs (time to first token, inter-token
gap, end to end) of each run and, for a concurrency sweep, throughput and p99 TTFT against
concurrency. Draws from result dicts only; matplotlib (the `plot` extra, Agg backend) is
imported when drawing, never at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.loadgen.stats import label

_CDFS = (
    ("ttft_ms", "time to first token", "share of requests"),
    ("itl_ms", "inter-token gap", "share of gaps"),
    ("e2e_ms", "end to end", "share of requests"),
)


def require() -> None:
    """Raise ImportError now, before a run, when matplotlib is missing."""
    import matplotlib  # noqa: F401


def is_sweep(results: Sequence[dict[str, Any]]) -> bool:
    """Several closed-loop runs at different concurrencies."""
    levels = {r["config"].get("concurrency") for r in results if r["config"]["loop"] == "closed"}
    return len(results) > 1 and len(levels) == len(results)


def draw(results: Sequence[dict[str, Any]], directory: Path) -> list[Path]:
    """Write latency-cdf.png (and throughput.png for a sweep) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [draw_cdfs(results, directory / "latency-cdf.png")]
    if is_sweep(results):
        paths.append(draw_throughput(results, directory / "throughput.png"))
    return paths


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(results: Sequence[dict[str, Any]]) -> str:
    c = results[0]["config"]
    mode = "streamed" if c["stream"] else "not streamed"
    return f"{c['target']}  {c['endpoint']} ({mode})  {c['workload']}"


def draw_cdfs(results: Sequence[dict[str, Any]], out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(_CDFS), figsize=(15, 4.6))
    for ax, (key, name, share_of) in zip(axes, _CDFS, strict=True):
        drawn = False
        for r in results:
            values = r["cdf"][key]
            if values:
                share = [p / 100 for p in r["cdf"]["percent"]]
                ax.plot(values, share, label=f"{label(r['config'])} (p99 {r[key]['p99']:.1f})")
                drawn = True
        if drawn and _spread(results, key) > 30:
            ax.set_xscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=name, xlabel="ms", ylabel=share_of, ylim=(0, 1.02))
        ax.grid(alpha=0.3, which="both")
        if drawn:
            ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Latency CDFs — {_title(results)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _spread(results: Sequence[dict[str, Any]], key: str) -> float:
    """How many times the largest value is the smallest (positive) one."""
    values = [v for r in results for v in r["cdf"][key] if v > 0]
    return max(values) / min(values) if values else 1.0


def draw_throughput(results: Sequence[dict[str, Any]], out: Path) -> Path:
    """Output tokens/s (each point labelled with its requests/s) and, on a second axis, the
    p99 and p50 TTFT against concurrency."""
    plt = _pyplot()
    rows = sorted(results, key=lambda r: int(r["config"]["concurrency"]))
    xs = [int(r["config"]["concurrency"]) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 5))
    ttft = ax.twinx()
    tokens = [r["output_tokens_per_s"] for r in rows]
    lines = [ax.plot(xs, tokens, "o-", color="C2", label="output tokens/s (labels: requests/s)")[0]]
    for x, y, r in zip(xs, tokens, rows, strict=True):
        ax.annotate(
            f"{r['requests_per_s']:.1f} req/s",
            (x, y),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8,
            color="C2",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
        )
    for p, style in (("p99", "^--"), ("p50", "v:")):
        values = [_nan(r["ttft_ms"][p]) for r in rows]
        lines += ttft.plot(xs, values, style, color="C3", label=f"{p} TTFT (ms)")
    ax.set_ylabel("output tokens/s", color="C2")
    ttft.set_ylabel("time to first token (ms)", color="C3")
    for axis in (ax, ttft):
        axis.set_ylim(bottom=0, top=axis.get_ylim()[1] * 1.12)
    if max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (closed-loop clients)")
    ax.grid(alpha=0.3)
    ax.legend(handles=lines, loc="upper left", fontsize=9)
    ax.set_title(f"Throughput vs concurrency — {_title(results)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
