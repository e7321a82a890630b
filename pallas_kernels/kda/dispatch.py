"""The implementations of chunked KDA and of the KDA decode step, and which problems each runs
(``pallas_kernels/dispatch.py`` is the mechanism and the policy).

Order is the policy's preference: on GPU "pallas_gpu" wherever it supports the call, else "xla";
"mosaic_tpu" has run only in TPU interpret mode, so it is never a default and TPU and CPU keep
"xla". Named explicitly, "pallas_gpu" runs in Pallas interpret mode on CPU and "mosaic_tpu" in
TPU interpret mode (how the tests run them).

The problems: chunked KDA ``(lower_bound, K, V)``, where ``lower_bound`` is the caller's promise
that every ``g >= lower_bound`` (None: no promise); the decode step ``(K, V)``.
"""

from __future__ import annotations

from pallas_kernels.dispatch import Implementation
from pallas_kernels.kda.chunk_math import LOWER_BOUND_MIN
from pallas_kernels.kda.differentiable import run_mosaic_tpu, run_pallas_gpu, run_xla
from pallas_kernels.kda.mosaic_tpu.decode import tpu_kda_decode
from pallas_kernels.kda.reference import recurrent_kda_step
from pallas_kernels.kda.triton.decode import triton_kda_decode
from pallas_kernels.kda.triton.intra_blocks import triton_takes
from pallas_kernels.platform import PLATFORMS, current_platform

_ALL = frozenset(PLATFORMS)


def safe_gate(*, lower_bound: float | None, **_: object) -> str | None:
    """The chunk kernels' midpoint factorisation needs the safe gate, ``lower_bound`` in [-5, 0)."""
    if lower_bound is None or not LOWER_BOUND_MIN <= lower_bound < 0:
        return (f"no chunk kernel for an unbounded gate: needs lower_bound in "
                f"[{LOWER_BOUND_MIN}, 0) (every g >= lower_bound), got lower_bound={lower_bound!r}")
    return None


def unsegmented(*, segmented: bool = False, **_: object) -> str | None:
    """Traced segment ids (packed documents resetting the state) are run by "xla" only."""
    return "segment_ids (state resets inside a row) are run by 'xla' only" if segmented else None


def triton_widths(*, K: int, V: int, **_: object) -> str | None:
    """On GPU the Triton kernels need K and V powers of two >= 16 (interpret mode takes any)."""
    if current_platform() == "gpu" and not triton_takes(K, V):
        return f"the Triton kernels need K and V powers of two >= 16 on GPU, got K={K}, V={V}"
    return None


def chunk_pallas_gpu_supports(*, lower_bound: float | None, K: int, V: int,
                              segmented: bool = False) -> str | None:
    return (safe_gate(lower_bound=lower_bound) or triton_widths(K=K, V=V)
            or unsegmented(segmented=segmented))


def chunk_mosaic_tpu_supports(*, lower_bound: float | None, segmented: bool = False,
                              **_: object) -> str | None:
    return safe_gate(lower_bound=lower_bound) or unsegmented(segmented=segmented)


CHUNK_IMPLEMENTATIONS: dict[str, Implementation] = {
    "pallas_gpu": Implementation("pallas_gpu", run_pallas_gpu, frozenset({"gpu", "cpu"}),
                                 default_on=frozenset({"gpu"}),
                                 supports=chunk_pallas_gpu_supports),
    "mosaic_tpu": Implementation("mosaic_tpu", run_mosaic_tpu, frozenset({"tpu", "cpu"}),
                                 supports=chunk_mosaic_tpu_supports),
    "xla": Implementation("xla", run_xla, _ALL, default_on=_ALL),
}

DECODE_IMPLEMENTATIONS: dict[str, Implementation] = {
    "pallas_gpu": Implementation("pallas_gpu", triton_kda_decode, frozenset({"gpu", "cpu"}),
                                 default_on=frozenset({"gpu"}), supports=triton_widths),
    "mosaic_tpu": Implementation("mosaic_tpu", tpu_kda_decode, frozenset({"tpu", "cpu"})),
    "xla": Implementation("xla", recurrent_kda_step, _ALL, default_on=_ALL),
}
