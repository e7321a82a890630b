"""MXFP4 tile decode in inline PTX for the GPU kernels: two codes per 32-bit instruction.

Same contract as `mxfp4_tile.decode_tile` (packed uint8 [R, C/2] + E8M0 scales [R, C/32] -> bf16 [R, C]);
the two agree bit for bit for scale bytes 2..252 (every trained weight). Why PTX: Triton compiles the jnp
decode one element at a time (uint8 lanes, compares and selects), about 740 SASS instructions per thread per
k step of the fused gate+up kernel at 128x(2x128)x64 tiles, which is more issue time than the MMAs of that
step. Here each instruction handles a bf16 pair (SWAR), about 460 per step (counted on sm_90 SASS).

Per four packed bytes (eight codes), for the low nibbles (the high ones shift by 4 less):
  prmt        spread two bytes into the two 16-bit lanes of a register;
  shl / and   code bits e1 e0 m -> bf16 bits 8..6 and the sign -> bit 15: the bf16 whose exponent field
              is e and whose top mantissa bit is m is E2M1 * 2^-126 exactly, the 0.5 code landing on the
              subnormal 2^-127 (E2M1's own subnormal lines up with bf16's);
  mul.bf16x2  times 2^126 (now +-E2M1 exactly, normal), then times the scale 2^(s-127) (bf16 bits s << 7,
              built in jnp once per 32 weights; scale byte 0 gives +0, i.e. zero blocks stay zero).
bf16x2 multiplies on sm_90 keep subnormal inputs (no .ftz form exists for bf16), and every product is a
power-of-two scaling, hence exact while the result is normal.

Pallas-Triton's inline asm returns one result per call (several results do not lower in JAX 0.11), so the
low and the high nibbles are two calls joined afterwards; each call sees four bytes per instance (pack=4).
Interpret mode cannot run PTX: the kernels use `mxfp4_tile.decode_tile` there.

Status: WRONG on the H200 (2026-11-29, benchmarks/moe_mxfp4_h200.py: rel err ~1 against the decoded
reference, every case), while tests/moe's instruction-level model of this PTX matches the release decode
bit for bit. So the bit logic holds and the assumption that fails is the interface: which tensor
elements Triton packs into $2..$4 and in which order it unpacks $0, $1. Off by default (TileConfig.ptx_decode)
until that is pinned down on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltr

from pallas_kernels.moe.mxfp4_order import bytes_in_fragment_order
from pallas_kernels.moe.mxfp4_tile import BLOCK


def _asm(code_shift: int, sign_shift: int) -> str:
    """PTX for one nibble of each of four bytes ($2) with their scales ($3, $4: bf16 pairs) -> $0, $1."""
    lines = ["{", ".reg .b32 zero, two126, q, t, u;", "mov.b32 zero, 0;", "mov.b32 two126, 0x7E807E80;"]
    for out, selector in ((0, "0x4140"), (1, "0x4342")):  # bytes 0, 1 -> $0; bytes 2, 3 -> $1
        lines += [
            f"prmt.b32 q, $2, zero, {selector};",
            f"shl.b32 t, q, {code_shift};",
            "and.b32 t, t, 0x01C001C0;",
            f"shl.b32 u, q, {sign_shift};",
            "and.b32 u, u, 0x80008000;",
            "or.b32 t, t, u;",
            "mul.rn.bf16x2 t, t, two126;",
            f"mul.rn.bf16x2 ${out}, t, ${3 + out};",
        ]
    return "\n".join([*lines, "}"])


_LOW_NIBBLES = _asm(code_shift=6, sign_shift=12)
_HIGH_NIBBLES = _asm(code_shift=2, sign_shift=8)


def decode_tile_ptx(packed: jax.Array, scale: jax.Array, fragment: bool = False) -> jax.Array:
    """uint8 packed [R, C/2] and scale [R, C/32] -> bf16 [R, C], inside a Pallas-Triton kernel on GPU.

    fragment: the C columns come out in fragment order (mxfp4_order.py; C is one k step)."""
    rows, half = packed.shape
    if scale.shape != (rows, 2 * half // BLOCK):
        raise ValueError(f"MXFP4 tile: packed {packed.shape} needs scale ({rows}, {2 * half // BLOCK}), "
                         f"got {scale.shape}")
    factor = jax.lax.bitcast_convert_type(scale.astype(jnp.uint16) << 7, jnp.bfloat16)  # 2^(s - 127)
    per_byte = jnp.broadcast_to(factor[:, :, None], (rows, half * 2 // BLOCK, BLOCK // 2)).reshape(rows, half)
    if fragment:
        packed, per_byte = bytes_in_fragment_order(packed), bytes_in_fragment_order(per_byte)
    out = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
    low, high = (
        pltr.elementwise_inline_asm(asm, args=[packed, per_byte], constraints="=r,=r,r,r,r", pack=4,
                                    result_shape_dtypes=[out])[0]
        for asm in (_LOW_NIBBLES, _HIGH_NIBBLES)
    )
    return jnp.stack([low, high], axis=-1).reshape(rows, 2 * half)
