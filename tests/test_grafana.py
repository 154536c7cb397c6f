"""The Grafana dashboard only names metrics the orchestrator and the reference worker export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from disagg.cluster import Cluster, StaticDiscovery
from disagg.engine.metrics import EngineMetrics
from disagg.telemetry import Metrics

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "disagg.json"


def test_dashboard_queries_exported_metrics() -> None:
    metrics = Metrics()
    metrics.watch(Cluster(StaticDiscovery(["http://c:1"], ["http://g:2"])), {})
    engine = EngineMetrics("generation")
    engine.step("decode", 0.01)
    engine.moved_in(1024, 0.001)
    stats = {
        "running": 0,
        "waiting": 0,
        "pinned": 0,
        "handoffs": 0,
        "steps": 1,
        "auth_refused": 0,
        "transfers": {"fetch_served": 0},
        "kv": {"free": 1, "used": 0, "cached": 0, "queried_tokens": 0, "hit_tokens": 0},
    }
    text = metrics.render().decode() + engine.render(stats).decode()
    exported = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    names = set()  # histograms and counters are queried by their sample names
    for name in exported:
        names |= {name, f"{name}_total", f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    dashboard = json.loads(DASHBOARD.read_text())
    used = {
        m
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for m in re.findall(r"\bdisagg_[a-z_]+", target["expr"])
    }
    assert used and used <= names, used - names
