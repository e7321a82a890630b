"""Where device time goes: a call run under `jax.profiler.trace`, its Perfetto JSON summed by event name.

Shared by the benchmark scripts (`from benchmarks.trace import traced_ops`, repository root on
PYTHONPATH). Device events are counted where the trace has any (GPU), else every complete event.
"""

from __future__ import annotations

import collections
import gzip
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

# Event names of this repository's Pallas kernels (KDA, the MoE grouped GEMMs, their Mosaic GPU forms).
KERNEL_PREFIXES = ("kda_", "k3_moe_")


def summarise_trace(trace_dir: Path) -> list[dict]:
    """Total time per event name, largest first: [{"op", "total_us", "calls", "share"}]."""
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return []
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name.upper()}
    totals, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or (device_pids and e.get("pid") not in device_pids):
            continue
        totals[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    whole = sum(totals.values()) or 1
    return [{"op": name, "total_us": us, "calls": counts[name], "share": us / whole}
            for name, us in totals.most_common()]


def traced_ops(fn: Callable[[], object]) -> list[dict]:
    """Run `fn()` once under the profiler (compile it first) and summarise its trace."""
    trace_dir = Path(tempfile.mkdtemp(prefix="k3jax_trace_"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        jax.block_until_ready(fn())
    return summarise_trace(trace_dir)


def kernels_share(ops: list[dict]) -> float:
    """The fraction of traced device time spent in this repository's Pallas kernels."""
    return sum(op["share"] for op in ops if op["op"].startswith(KERNEL_PREFIXES))
