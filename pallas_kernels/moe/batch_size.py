"""Which regime a routed batch is in, from static shapes only (group sizes are data).

Shared by the Triton tile choice (`triton/tiles.py`) and the "pallas_gpu" kernel plan (`pallas_gpu.py`).
"""

from __future__ import annotations

DECODE_GROUP_ROWS = 32  # routed rows per expert, on average, up to which a batch is decode-sized


def is_decode_sized(num_rows: int, num_groups: int) -> bool:
    """At most DECODE_GROUP_ROWS routed rows per expert on average (e.g. a decode step: 256 rows over
    28 local experts): reading the weights, not the MMAs, sets the time."""
    return num_rows <= DECODE_GROUP_ROWS * num_groups
