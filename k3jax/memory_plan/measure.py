"""Compile a lowered program and read XLA's memory accounting of one device's partition.

Per program, peak bytes per device = arguments + outputs - aliased (donated) + temporaries, from
`compiled.memory_analysis()`. Figures of two reduced depths extrapolate linearly to the full depth
(`extrapolate`): the layer scan makes per-layer costs exactly linear (one group body, stacked weights
and caches), so two points determine the line.
"""

from __future__ import annotations

import dataclasses
import time

from k3jax.memory_plan.programs import Lowering


@dataclasses.dataclass
class Program:
    name: str
    argument: int
    output: int
    alias: int
    temp: int
    seconds: float  # lowering and compiling

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def measure(name: str, lower: Lowering) -> Program:
    start = time.perf_counter()
    m = lower().compile().memory_analysis()
    return Program(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes, time.perf_counter() - start)


def extrapolate(a: Program, b: Program, la: int, lb: int, target: int) -> Program:
    """Linear in depth through (la, a) and (lb, b), evaluated at `target` layers."""
    t = (target - la) / (lb - la)

    def at(x: int, y: int) -> int:
        return int(round(x + (y - x) * t))

    return Program(a.name, at(a.argument, b.argument), at(a.output, b.output), at(a.alias, b.alias),
                   at(a.temp, b.temp), a.seconds + b.seconds)
