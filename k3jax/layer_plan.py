"""How the decoder layers are laid out for compilation: an unrolled head, scanned groups, an unrolled tail.

Compile time must not grow with depth, so the longest run of identical groups of (mixer, FFN) kinds
is stacked and run with `lax.scan`. For K3 that is 22 groups of [KDA, KDA, KDA, MLA] (layers
4-91); layers 0-3 (layer 0 has the dense FFN) and 92 (the extra final MLA) stay unrolled.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

MAX_PERIOD = 8


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    num_layers: int
    start: int  # first scanned layer
    period: int  # layers per scanned group
    num_groups: int

    @property
    def head(self) -> range:
        return range(0, self.start)

    @property
    def tail(self) -> range:
        return range(self.start + self.period * self.num_groups, self.num_layers)

    def slot(self, layer: int) -> tuple[str, int, int]:
        """('head', i, 0) | ('group', g, j) | ('tail', t, 0) for a 0-based layer index."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if layer < self.start:
            return ("head", layer, 0)
        offset = layer - self.start
        if offset < self.period * self.num_groups:
            return ("group", offset // self.period, offset % self.period)
        return ("tail", layer - self.tail.start, 0)


def plan_layers(kinds: Sequence[object]) -> LayerPlan:
    """Pick the (start, period) whose repeated groups cover most layers; prefer aligned, early starts."""
    n = len(kinds)
    best = LayerPlan(n, n, 1, 0)
    best_key = (0, False, 0)
    for period in range(1, MAX_PERIOD + 1):
        for start in range(0, n - 2 * period + 1):
            groups = 1
            while start + (groups + 1) * period <= n and all(
                kinds[start + groups * period + j] == kinds[start + j] for j in range(period)
            ):
                groups += 1
            if groups < 2:
                continue
            key = (groups * period, start % period == 0, -start)
            if key > best_key:
                best, best_key = LayerPlan(n, start, period, groups), key
    return best
