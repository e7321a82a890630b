"""One dispatch mechanism for every op: a table of implementations and one policy that picks.

Each op (chunked KDA, KDA decode, routed experts, ...) declares an ordered table
`IMPLEMENTATIONS: dict[str, Implementation]`. An implementation states where it can run when asked
for by name (`platforms`; "cpu" means Pallas interpret mode, for tests) and where the policy may
pick it unasked (`default_on`: only platforms it has been verified on), plus `supports`, which
says why it cannot run a given problem (shapes, dtypes, gate bounds) or None when it can.

`choose` is the policy, called once at the op's entry: a named implementation must run here or
the call fails with the reason; `None` takes the first entry of the table that is a default on
this platform and supports the problem. Backends never pick defaults themselves, tile
configurations never decide the backend, and the platform is read only in `platform.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pallas_kernels.platform import Platform, current_platform


def _always(**problem: Any) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One backend of an op: its entry function and where and for which problems it runs."""

    name: str
    run: Callable[..., Any]
    platforms: frozenset[Platform]
    default_on: frozenset[Platform] = frozenset()
    supports: Callable[..., str | None] = _always


def choose(
    op: str, table: Mapping[str, Implementation], requested: str | None, **problem: Any
) -> Implementation:
    """The implementation of `op` to run: `requested` by name, or the policy's default when None."""
    platform = current_platform()
    if requested is None:
        for impl in table.values():
            if platform in impl.default_on and impl.supports(**problem) is None:
                return impl
        raise NotImplementedError(f"{op}: no implementation runs this problem on {platform!r} ({problem})")
    impl = table.get(requested)
    if impl is None:
        raise ValueError(f"{op}: implementation {requested!r} is unknown; expected one of {tuple(table)} or None")
    if platform not in impl.platforms:
        raise NotImplementedError(
            f"{op}: implementation {requested!r} runs on {sorted(impl.platforms)}, not {platform!r}"
        )
    reason = impl.supports(**problem)
    if reason is not None:
        raise NotImplementedError(f"{op}: implementation {requested!r} cannot run this problem: {reason}")
    return impl
