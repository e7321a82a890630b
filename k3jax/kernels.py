"""Which kernel implementation each op of the model runs: one small, frozen choice per model.

Every field names an entry of that op's dispatch table (`pallas_kernels/*/dispatch.py`
`IMPLEMENTATIONS`), or None for the table's policy (the fastest implementation verified on this
platform that supports the call). The choice is static: it is part of the model's structure, so a
jitted forward compiles for it, and every call site (prefill, decode, expert-parallel) honours it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Kernels:
    kda: str | None = None  # chunked KDA (prefill, training)
    kda_decode: str | None = None  # one recurrent KDA step
    moe: str | None = None  # routed experts' grouped products
    mla: str | None = None  # MLA prefill attention (pallas_kernels/mla)

    @classmethod
    def of(cls, value: "Kernels | Mapping[str, str | None] | None") -> "Kernels":
        """A Kernels from a Kernels, a mapping of field names (e.g. `{"kda": "xla"}`) or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"kernels: expected a Kernels, a mapping or None, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"kernels: unknown op(s) {unknown}; expected some of {sorted(fields)}")
        for name, choice in value.items():
            if choice is not None and not isinstance(choice, str):
                raise TypeError(f"kernels[{name!r}]: expected an implementation name or None, got {choice!r}")
        return cls(**value)
