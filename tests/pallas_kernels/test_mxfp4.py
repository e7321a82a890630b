"""MXFP4 decode/encode against tables and a float64 quantiser written independently here."""

import math

import jax
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.mxfp4 import decode_mxfp4, decode_mxfp4_jax, encode_mxfp4

# E2M1 codes 0-7 (0bSEEM with S = 0), written out by hand; codes 8-15 are the negatives.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_value(code: int) -> float:
    return math.copysign(E2M1[code & 7], -1.0 if code & 8 else 1.0)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality that also tells -0.0 from 0.0."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_all_256_bytes_decode_to_their_nibble_pair():
    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scale = np.full((16, 1), 127, np.uint8)  # 2^0
    out = decode_mxfp4(packed, scale)
    assert out.shape == (16, 32) and out.dtype == np.float32
    expected = np.array(
        [[e2m1_value(b & 0xF), e2m1_value(b >> 4)] for b in range(256)], np.float32
    ).reshape(16, 32)
    assert same_bits(out, expected)


def test_scale_bytes_are_powers_of_two():
    scale = np.arange(255, dtype=np.uint8)[:, None]  # every valid E8M0 byte
    packed = np.full((255, 16), 0x22, np.uint8)  # every element is 1.0
    out = decode_mxfp4(packed, scale, dtype=np.float64)
    expected = np.array([math.ldexp(1.0, b - 127) for b in range(255)])
    assert np.array_equal(out, np.repeat(expected[:, None], 32, axis=1))
    # float32 keeps 2^-127 as a subnormal (numpy does not flush)
    assert decode_mxfp4(packed[:1], scale[:1])[0, 0] == np.float32(2.0**-127)


def test_scale_nan_byte_is_rejected():
    with pytest.raises(ValueError, match="255"):
        decode_mxfp4(np.zeros((2, 16), np.uint8), np.array([[127], [255]], np.uint8))


@pytest.mark.parametrize(
    "packed_shape, scale_shape, dtypes, match",
    [
        ((4, 16), (4, 2), (np.uint8, np.uint8), r"\(4, 16\).*\(4, 2\)"),
        ((4, 16), (3, 1), (np.uint8, np.uint8), r"\(4, 16\).*\(3, 1\)"),
        ((4, 16), (4, 1), (np.int8, np.uint8), r"uint8.*\(4, 16\)"),
        ((4, 16), (4, 1), (np.uint8, np.float32), r"uint8.*\(4, 1\)"),
        ((16,), (4, 1), (np.uint8, np.uint8), r"\(16,\).*\(4, 1\)"),
    ],
)
def test_shape_and_dtype_errors(packed_shape, scale_shape, dtypes, match):
    packed, scale = np.zeros(packed_shape, dtypes[0]), np.zeros(scale_shape, dtypes[1])
    with pytest.raises(ValueError, match=match):
        decode_mxfp4(packed, scale)
    with pytest.raises(ValueError, match=match):
        decode_mxfp4_jax(packed, scale)


def test_leading_axes_are_kept():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 5, 32), dtype=np.uint8)
    scale = rng.integers(100, 150, (3, 5, 2), dtype=np.uint8)
    out = decode_mxfp4(packed, scale)
    assert out.shape == (3, 5, 64)
    assert same_bits(out[1], decode_mxfp4(packed[1], scale[1]))


def random_encoding(rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random codes whose 32-blocks each reach |4| or |6|, i.e. what the OCP quantiser emits."""
    codes = rng.integers(0, 16, (rows, cols // 32, 32), dtype=np.uint8)
    peak = rng.integers(0, 32, (rows, cols // 32))
    top = rng.choice(np.array([6, 7, 14, 15], np.uint8), (rows, cols // 32))
    np.put_along_axis(codes, peak[..., None], top[..., None], axis=-1)
    codes = codes.reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, rng.integers(1, 253, (rows, cols // 32), dtype=np.uint8)


def test_round_trip_of_representable_values():
    packed, scale = random_encoding(np.random.default_rng(1), 48, 128)
    w = decode_mxfp4(packed, scale)
    packed2, scale2 = encode_mxfp4(w)
    assert np.array_equal(packed2, packed) and np.array_equal(scale2, scale)
    assert same_bits(decode_mxfp4(packed2, scale2), w)


def reference_quantise(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MXFP4 quantiser in float64, element by element, with explicit ties-to-even."""
    rows, cols = w.shape
    codes = np.zeros((rows, cols), np.uint8)
    scale = np.zeros((rows, cols // 32), np.uint8)
    for r in range(rows):
        for b in range(cols // 32):
            block = [float(x) for x in w[r, 32 * b : 32 * b + 32]]
            amax = max(abs(x) for x in block)
            e = -127
            if amax > 0:
                e = math.floor(math.log2(amax))
                e += (2.0 ** (e + 1) <= amax) - (2.0**e > amax)  # guard log2 rounding
                e = min(max(e - 2, -127), 127)
            scale[r, b] = e + 127
            for i, x in enumerate(block):
                y = abs(x) / 2.0**e
                dist = [abs(y - g) for g in E2M1]
                best = min(range(8), key=lambda k: (dist[k], k % 2))  # tie -> even code
                codes[r, 32 * b + i] = best | (8 if math.copysign(1.0, x) < 0 else 0)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def test_quantiser_matches_reference_on_random_data():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 256)) * np.exp2(rng.integers(-40, 40, (24, 1)))
    w = w.astype(np.float32)
    w[3, :32] = 0.0  # all-zero block
    w[4, 32:64] = np.float32(2.0**-140)  # subnormal block: exponent clamped at -127
    # exact E2M1 ties around a block maximum of 4 * 2^3
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 7.0, 4.0], np.float32)
    w[5, 64 : 64 + ties.size] = ties * 8
    packed, scale = encode_mxfp4(w)
    ref_packed, ref_scale = reference_quantise(w)
    assert np.array_equal(scale, ref_scale)
    assert np.array_equal(packed, ref_packed)
    assert scale[3, 0] == 0 and not decode_mxfp4(packed, scale)[3, :32].any()
    decoded_ties = decode_mxfp4(packed, scale)[5, 64 : 64 + ties.size] / 8
    assert decoded_ties.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -0.0, 6.0, 4.0]


def test_encode_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_mxfp4(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        encode_mxfp4(np.full((2, 32), np.inf, np.float32))


def test_jax_decode_equals_numpy_bit_for_bit():
    packed, _ = random_encoding(np.random.default_rng(3), 64, 256)
    packed = np.concatenate([packed, np.arange(256, dtype=np.uint8).reshape(2, 128)])
    rng = np.random.default_rng(4)
    # bytes 2..252: every product is a finite float32 normal (XLA flushes subnormals)
    scale = rng.integers(2, 253, (66, 8), dtype=np.uint8)
    scale[0] = [2, 3, 126, 127, 128, 200, 251, 252]
    ref = decode_mxfp4(packed, scale)
    assert same_bits(jax.jit(decode_mxfp4_jax, static_argnums=2)(packed, scale, np.float32), ref)
    bf16 = decode_mxfp4_jax(packed, scale, ml_dtypes.bfloat16)
    assert bf16.dtype == ml_dtypes.bfloat16
    assert np.array_equal(np.asarray(bf16).view(np.uint16),
                          decode_mxfp4(packed, scale, dtype=ml_dtypes.bfloat16).view(np.uint16))


def test_jax_decode_nan_scale_gives_nan():
    out = decode_mxfp4_jax(np.full((1, 16), 0x22, np.uint8), np.array([[255]], np.uint8))
    assert np.isnan(np.asarray(out)).all()
