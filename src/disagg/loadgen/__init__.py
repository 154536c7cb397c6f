"""The load generator behind `disagg bench`: workloads, the closed- and open-loop runner,
the result's statistics, a progress line and charts. `run_load` (async) and `run_sweep` are
the entry points for other commands and scripts.
"""

from disagg.loadgen.runner import (
    Arrivals,
    ClosedLoop,
    LoadSpec,
    OpenLoop,
    base_url,
    concurrency_sweep,
    parse_concurrency,
    run_load,
    run_sweep,
)
from disagg.loadgen.workloads import WorkloadError, parse_workload

__all__ = [
    "Arrivals",
    "ClosedLoop",
    "LoadSpec",
    "OpenLoop",
    "WorkloadError",
    "base_url",
    "concurrency_sweep",
    "parse_concurrency",
    "parse_workload",
    "run_load",
    "run_sweep",
]
