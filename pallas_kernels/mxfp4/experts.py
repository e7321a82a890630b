"""Routed-expert weights kept MXFP4-packed: the pytree the model holds and the kernels read."""

from __future__ import annotations

from typing import NamedTuple

import jax

from pallas_kernels.mxfp4.codec import decode_mxfp4_jax


class MXFP4Experts(NamedTuple):
    """Stacked expert weights [..., E, out, in] as the release stores them (4.25 bits per weight).

    packed: uint8 [..., E, out, in/2], two E2M1 codes per byte (even input column in the low nibble);
    scale: uint8 [..., E, out, in/BLOCK], raw E8M0 bytes (2^(byte - 127)) per block of BLOCK inputs.
    """

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded shape [..., E, out, in]."""
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def decode(self, dtype) -> jax.Array:
        """E2M1(code) * 2^(scale - 127) in float32, cast to `dtype` (exact for bf16 and fp32: E2M1 has one
        mantissa bit). Under jit this is an elementwise op XLA fuses into the producer of the GEMM operand."""
        return decode_mxfp4_jax(self.packed, self.scale, dtype)


def decode_experts(w: jax.Array | MXFP4Experts, dtype) -> jax.Array:
    """Expert weights as a dense [E, out, in] array of `dtype`; dense arrays pass through unchanged."""
    return w.decode(dtype) if isinstance(w, MXFP4Experts) else w
