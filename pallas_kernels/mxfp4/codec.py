"""MXFP4 (OCP microscaling: E2M1 elements, one E8M0 scale per BLOCK inputs) encode and decode.

Layout of the K3 release (compressed-tensors ``mxfp4-pack-quantized``): ``weight_packed`` is uint8
[..., in/2] with the even input column in the low nibble and the odd one in the high nibble;
``weight_scale`` is uint8 [..., in/BLOCK] holding raw E8M0 bytes, value 2^(byte - 127).
Leading axes (e.g. stacked experts) are allowed and must agree between the two arrays.

Two decoders: ``decode_mxfp4`` on the host (numpy, for loaders: table lookups, exact, with errors
that name what is wrong) and ``decode_mxfp4_jax`` (jit-friendly, for the model and the kernels'
references). The kernels' own in-register decodes are in ``layouts.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK = 32  # inputs per E8M0 scale byte
E2M1_MAX_EXP = 2  # 6 = 1.5 * 2^2: largest E2M1 exponent, the OCP shared-exponent offset
SCALE_NAN = 255  # the E8M0 NaN byte

# ml_dtypes' own decodings: the E2M1 values of a byte's two codes (low nibble first) and every E8M0 byte.
_CODE_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
_PAIR_VALUES = np.stack([_CODE_VALUES[np.arange(256) & 0x0F], _CODE_VALUES[np.arange(256) >> 4]], axis=-1)
# the same pairs as one uint64 per byte: `np.take` on a 1-D table is several times faster than
# numpy's fancy indexing of a [256, 2] one
_PAIR_VALUES_64 = np.ascontiguousarray(_PAIR_VALUES).view(np.uint64).reshape(256)
_SCALE_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def check_mxfp4(packed, scale) -> None:
    """Reject arrays that cannot be a packed/scale pair, naming both shapes (numpy, jax or abstract arrays)."""
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 packed and scale must be uint8, got {packed.dtype} {tuple(packed.shape)} "
            f"and {scale.dtype} {tuple(scale.shape)}"
        )
    if packed.ndim < 1 or packed.ndim != scale.ndim or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"MXFP4 packed {tuple(packed.shape)} and scale {tuple(scale.shape)} must have the "
            "same leading (row) dimensions"
        )
    if 2 * packed.shape[-1] != BLOCK * scale.shape[-1]:
        raise ValueError(
            f"MXFP4 packed {tuple(packed.shape)} holds {2 * packed.shape[-1]} input columns but "
            f"scale {tuple(scale.shape)} covers {BLOCK * scale.shape[-1]} (one byte per {BLOCK})"
        )


def decode_mxfp4(packed: np.ndarray, scale: np.ndarray, *, dtype=np.float32) -> np.ndarray:
    """Dequantise on the host, exactly: E2M1(code) * 2^(scale - 127), shape [..., in].

    Products are formed in float32 (float64 when that is requested), where every product is exact
    (subnormals included) except those of 2^128 or more (|value| >= 4 at scale byte 253, >= 2 at
    254), which overflow to inf; the result is then cast to ``dtype``. MXFP4 values have at most
    two significant bits, so the cast to bfloat16 is exact too (the top half of the float32 bits).
    """
    packed, scale = np.asarray(packed), np.asarray(scale)
    check_mxfp4(packed, scale)
    if np.any(scale == SCALE_NAN):
        rows = np.argwhere(scale == SCALE_NAN)[:3].tolist()
        raise ValueError(f"MXFP4 scale {tuple(scale.shape)} holds the E8M0 NaN byte 255 at {rows}")
    shape = (*packed.shape[:-1], 2 * packed.shape[-1])
    if np.dtype(dtype) == np.float64:
        values = _PAIR_VALUES.astype(np.float64)[packed].reshape(*scale.shape, BLOCK)
        factor = _SCALE_VALUES.astype(np.float64)[scale]
    else:
        values = np.take(_PAIR_VALUES_64, packed).view(np.float32).reshape(*scale.shape, BLOCK)
        factor = np.take(_SCALE_VALUES, scale)
    with np.errstate(over="ignore"):  # the documented overflow to inf
        values = (values * factor[..., None]).reshape(shape)
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) and values.dtype == np.float32:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    return values.astype(dtype)


def decode_mxfp4_jax(packed, scale, dtype=jnp.float32):
    """Dequantise with jax.numpy (jit-friendly): nibble split, 16-entry LUT gather, scale multiply.

    The power of two is built from its float32 bit pattern: XLA's exp2 is not exact (exp2(126.)
    is off in the 7th digit on CPU) and jnp.ldexp goes through a float pow. Scale byte 255 gives
    NaN (no error can be raised under jit). Equal to ``decode_mxfp4`` bit for bit in float32,
    except that XLA on CPU and GPU flushes subnormal results (scale byte 0, or 0.5 at byte 1) to
    zero.
    """
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    check_mxfp4(packed, scale)
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(
        packed.shape[:-1] + (2 * packed.shape[-1],)
    )
    values = jnp.asarray(_CODE_VALUES)[codes]
    s = scale.astype(jnp.uint32)
    bits = jnp.where(s == 0, jnp.uint32(1 << 22), s << 23)  # byte 0 is the subnormal 2^-127
    bits = jnp.where(s == SCALE_NAN, jnp.uint32(0x7FC00000), bits)
    factor = bits.view(jnp.float32)
    blocks = values.reshape(scale.shape + (BLOCK,)) * factor[..., None]
    return blocks.reshape(codes.shape).astype(dtype)


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise [..., in] weights with the OCP rule; returns (packed uint8, scale uint8).

    Shared exponent e = floor(log2(amax of the block)) - 2, clamped to [-127, 127]; elements
    x / 2^e are cast to E2M1 by ml_dtypes (round to nearest even, saturating at +-6). The input is
    taken as float32 first because ml_dtypes casts float64 to E2M1 through float32 (double rounding
    near E2M1 ties); x / 2^e of a float32 is exact, so the one rounding is the E2M1 cast.
    An all-zero block (log2 amax = -inf) gets the clamp's floor e = -127: scale byte 0 (2^-127)
    with zero codes, a valid encoding that decodes back to zeros.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 1 or w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 encode needs [..., in] with in a multiple of {BLOCK}, got {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"MXFP4 encode got non-finite values in an array of shape {w.shape}")
    blocks = w.astype(np.float64).reshape(w.shape[:-1] + (w.shape[-1] // BLOCK, BLOCK))
    amax = np.max(np.abs(blocks), axis=-1)
    _, amax_exp = np.frexp(amax)  # amax = m * 2^amax_exp, m in [0.5, 1): floor(log2) = amax_exp - 1
    exp = np.where(amax == 0, -127, np.clip(amax_exp - 1 - E2M1_MAX_EXP, -127, 127))
    scaled = np.ldexp(blocks, -exp[..., None]).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(w.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)
