"""MXFP4 tile decode written in integer jnp ops, so that it runs inside a Pallas-Triton kernel body.

The grouped GEMMs call `decode_tile` on each weight tile right after loading it: HBM holds (and the
kernel reads) only the release's 4.25 bits per weight, and the decoded bf16 tile lives in registers on
its way to the tensor-core dot. Ground truth is `codec.decode_mxfp4_jax` (one E2M1 code per nibble,
even input column in the low nibble, one E8M0 scale byte per BLOCK columns).

No lookup table and no float multiply: the bf16 bit pattern is assembled directly. For a code with
sign bit S and magnitude bits c3 = (e1 e0 m) and a scale byte s:

  c3 >= 2 (normal, value (1 + m/2) * 2^(e-1)):  bits = (c3 << 6) + ((s - 1) << 7)
      c3 << 6 puts e in the exponent field and m in the top mantissa bit; (s - 1) << 7 adds the scale's
      exponent and the E2M1 bias (exponent field e - 1 + s - 127 + 127 = e + s - 1);
  c3 == 1 (0.5):  bits = (s - 1) << 7;    c3 == 0:  bits = 0;
  then OR the sign into bit 15.

This is exact (bf16 has float32's exponent range and E2M1 one mantissa bit) for scale bytes 1..252,
which covers every block whose largest magnitude lies in [2^-124, 2^126). Bytes outside (0: blocks
below 2^-124, which the release writer emits only for all-zero blocks and which XLA's decode flushes
to zero anyway; 253..255: overflow or NaN) are clamped into that range instead of being checked,
since a kernel cannot raise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4.codec import BLOCK


def decode_tile(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """uint8 packed [R, C/2] (two codes per byte) and scale [R, C/BLOCK] -> dtype [R, C]."""
    rows, half = packed.shape
    cols = 2 * half
    if scale.shape != (rows, cols // BLOCK):
        raise ValueError(f"MXFP4 tile: packed {packed.shape} needs scale ({rows}, {cols // BLOCK}), got {scale.shape}")
    base = (jnp.clip(scale.astype(jnp.int32), 1, 252) - 1) << 7  # bf16 bits of 0.5 * 2^(s - 127)
    base = jnp.broadcast_to(base[:, :, None], (rows, cols // BLOCK, BLOCK // 2)).reshape(rows, half)  # per byte
    # even column in the low nibble: join(lo, hi) along a new last axis, then merge it into the columns
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, cols).astype(jnp.int32)
    base = jnp.stack([base, base], axis=-1).reshape(rows, cols)
    c3 = codes & 7
    magnitude = jnp.where(c3 >= 2, (c3 << 6) + base, c3 * base)
    bits = (magnitude | ((codes & 8) << 12)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dtype)
