"""`--plan-only`: the conversion plan as a table — target leaf, shape, dtype, bytes, transform, sources.

Stacked experts list their sources as one pattern (`experts.{0..895}.w1.weight_{packed,scale}`)
rather than one line per expert, so the table stays one line per written leaf.
"""

from __future__ import annotations

import math
import re

from k3jax.convert.plan import ConversionPlan, LeafPlan


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exp:.1f} {'KMGT'[exp - 1]}iB"


def _sources(leaf: LeafPlan) -> str:
    first = leaf.parts[0]
    if len(first) == 2:
        shown = re.sub(r"_packed$", "_{packed,scale}", first[0])
    else:
        shown = first[0]
    if leaf.kind == "experts":
        shown = re.sub(r"\.experts\.0\.", f".experts.{{0..{len(leaf.parts) - 1}}}.", shown)
    return shown


def format_plan(plan: ConversionPlan) -> str:
    rows = [("item", "leaf", "shape", "dtype", "bytes", "transform", "source")]
    for item in plan.items:
        for leaf in item.leaves:
            rows.append((item.name, leaf.target, "x".join(map(str, leaf.shape)) or "scalar", leaf.dtype.name,
                         str(leaf.nbytes), leaf.transform, _sources(leaf)))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["  ".join(cell.ljust(w) if i != 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             + "  " + row[6] for row in rows]
    largest = max(plan.items, key=lambda item: item.nbytes)
    lines.append("")
    lines.append(f"items: {len(plan.items)}, leaves: {sum(len(i.leaves) for i in plan.items)}, "
                 f"largest item: {largest.name} ({human_bytes(largest.nbytes)})")
    lines.append(f"total: {plan.nbytes} bytes written ({human_bytes(plan.nbytes)}) "
                 f"from {plan.source_bytes} bytes read ({human_bytes(plan.source_bytes)})")
    return "\n".join(lines)
