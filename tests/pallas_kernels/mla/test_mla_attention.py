"""MLA prefill attention: every implementation that runs on CPU against an independent float64 numpy
attention, the masks exactly, and the dispatch policy.

Shapes are K3's in miniature (H = 3 heads, N = 8 nope + P = 4 rope key dims, V = 6 value dims,
R = 10 latent rank). fp32 vs float64: two GEMMs over <= 12-term sums and a softmax over <= 40 keys,
~1e-7 relative; 1e-5 is a wide margin that any masking or scaling slip (>= 1e-2) breaks.
"""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pallas_kernels.dispatch as dispatch  # noqa: E402
from pallas_kernels.mla import (  # noqa: E402
    IMPLEMENTATIONS, blockwise_mla_attention, cudnn_chunk_mla_attention, cudnn_mla_attention, mla_prefill_attention,
    naive_mla_attention,
)
from pallas_kernels.mla.dispatch import (  # noqa: E402
    CUDNN_MAX_EXPANDED_BYTES, CUDNN_MAX_MASK_ELEMENTS, cudnn_chunk_supports, cudnn_masked_supports, cudnn_supports,
)

H, N, P, V, R = 3, 8, 4, 6, 10
SCALE = (N + P) ** -0.5
TOL = 1e-5


def numpy_attention(q, latents, w, offset, start, segments=None):
    """float64: expand keys/values, causal + left-padding (+ document) mask, softmax, weighted values."""
    q, latents, w = (np.asarray(a, np.float64) for a in (q, latents, w))
    batch, seq = q.shape[:2]
    kv = (latents[..., :R] @ w.T).reshape(batch, -1, H, N + V)
    k = np.concatenate([kv[..., :N], np.broadcast_to(latents[:, :, None, R:], (*kv.shape[:3], P))], -1)
    scores = np.einsum("bthd,bshd->bhts", q, k) * SCALE
    qp, kp = offset + np.arange(seq), np.arange(k.shape[1])
    mask = np.broadcast_to(kp[None, :] <= qp[:, None], (batch, seq, k.shape[1])).copy()
    if start is not None:
        mask &= (kp[None, None, :] >= np.asarray(start)[:, None, None]) | (kp[None, :] == qp[:, None])[None]
    if segments is not None:
        segments = np.asarray(segments)
        mask &= segments[:, :, None] == segments[:, None, :]
    scores = np.where(mask[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshv->bthv", probs, kv[..., N:])


def problem(seq, keys, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, seq, H, N + P)), jnp.float32)
    latents = jnp.asarray(rng.standard_normal((2, keys, R + P)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((H * (N + V), R)) / R**0.5, jnp.float32)
    return q, latents, w


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


BLOCKWISE = lambda **kw: blockwise_mla_attention(**kw, block_q=4, block_k=5)  # noqa: E731
CUDNN_AS_XLA = lambda **kw: cudnn_mla_attention(**kw, implementation="xla")  # noqa: E731
CHUNK_AS_XLA = lambda **kw: cudnn_chunk_mla_attention(**kw, implementation="xla")  # noqa: E731
# (seq, keys, offset, start): a whole prompt; a chunk at an offset in a larger cache; left padding
# deeper than the first chunk, and within it.
CASES = [(13, 13, 0, None), (9, 40, 17, None), (9, 40, 17, (20, 3)), (13, 13, 0, (5, 0))]
# The two-call chunk (no left padding): the first chunk of a larger cache (no past), one in the middle,
# and the last (its own keys end the cache).
CHUNK_CASES = [(9, 40, 0, None), (9, 40, 17, None), (9, 40, 31, None)]


# The cuDNN calls (value padding; cuDNN's causal mask for a whole prompt, an explicit mask otherwise;
# the chunk's two calls and log-sum-exp merge) run through XLA's attention on CPU.
RUNS = [(name, *case) for name in ("blockwise", "naive", "cudnn_as_xla") for case in CASES]
RUNS += [("chunk_as_xla", *case) for case in CHUNK_CASES]
FNS = {"blockwise": BLOCKWISE, "naive": naive_mla_attention, "cudnn_as_xla": CUDNN_AS_XLA, "chunk_as_xla": CHUNK_AS_XLA}


@pytest.mark.parametrize("name,seq,keys,offset,start", RUNS)
def test_matches_numpy(name, seq, keys, offset, start):
    fn = FNS[name]
    q, latents, w = problem(seq, keys)
    start_arr = None if start is None else jnp.asarray(start, jnp.int32)
    out = jax.jit(lambda q, lat, w: fn(q=q, latents=lat, w_kv_b=w, nope_dim=N, scale=SCALE, q_offset=offset,
                                       start=start_arr))(q, latents, w)
    assert out.shape == (2, seq, H, V)
    assert rel(out, numpy_attention(q, latents, w, offset, start)) <= TOL


@pytest.mark.parametrize("fn", [BLOCKWISE, CUDNN_AS_XLA], ids=["blockwise", "cudnn_as_xla"])
def test_hidden_keys_are_never_read(fn):
    """Exact masking: keys after the last query (unwritten cache rows) and left pads may hold anything
    (row 0's queries 17..19 are pads themselves and see their own keys, so its garbage stops at 17)."""
    q, latents, w = problem(9, 40)
    start = jnp.asarray([20, 3], jnp.int32)
    run = jax.jit(lambda lat: fn(q=q, latents=lat, w_kv_b=w, nope_dim=N, scale=SCALE, q_offset=17, start=start))
    garbage = latents.at[:, 26:].set(1e4).at[0, :17].set(-7e3).at[1, :3].set(5e3)
    np.testing.assert_array_equal(run(latents), run(garbage))


def test_chunk_never_reads_keys_past_its_last_query():
    """The two-call chunk: cache rows after the chunk (unwritten) may hold anything; the offset is traced,
    as the model's cache length is."""
    q, latents, w = problem(9, 40)
    run = jax.jit(lambda lat, offset: CHUNK_AS_XLA(q=q, latents=lat, w_kv_b=w, nope_dim=N, scale=SCALE,
                                                    q_offset=offset))
    for offset in (0, 17):
        garbage = latents.at[:, offset + 9:].set(1e4)
        np.testing.assert_array_equal(run(latents, offset), run(garbage, offset))
        assert rel(run(latents, offset), numpy_attention(q, latents, w, offset, None)) <= TOL


@pytest.mark.parametrize("past_block", [7, 10, 40])
def test_chunk_past_in_blocks_matches_numpy(past_block):
    """The chunk's past as several calls over blocks of cached positions (40 keys: 6 blocks of 7 with
    a padded tail, 4 of 10, one of 40), merged with its own keys; cache rows after the chunk may hold
    anything. The offset is traced, as the model's cache length is."""
    q, latents, w = problem(9, 40)
    run = jax.jit(lambda lat, offset: cudnn_chunk_mla_attention(
        q=q, latents=lat, w_kv_b=w, nope_dim=N, scale=SCALE, q_offset=offset, implementation="xla",
        past_block=past_block))
    for offset in (0, 10, 17, 31):
        out = run(latents, offset)
        assert rel(out, numpy_attention(q, latents, w, offset, None)) <= TOL
        np.testing.assert_array_equal(out, run(latents.at[:, offset + 9:].set(1e4), offset))


def test_blockwise_gradient_matches_naive():
    """The forward without a cache trains through the blockwise path: its gradient is the naive one's."""
    q, latents, w = problem(11, 11, seed=3)
    start = jnp.asarray([0, 4], jnp.int32)

    def loss(fn, q, lat, w):
        return jnp.sum(fn(q=q, latents=lat, w_kv_b=w, nope_dim=N, scale=SCALE, start=start) ** 2)

    got = jax.grad(lambda *a: loss(BLOCKWISE, *a), argnums=(0, 1, 2))(q, latents, w)
    want = jax.grad(lambda *a: loss(naive_mla_attention, *a), argnums=(0, 1, 2))(q, latents, w)
    for g, e in zip(got, want):
        assert np.all(np.isfinite(g)) and rel(g, e) <= TOL


def test_policy_and_cudnn_limits():
    q, latents, w = problem(5, 5)
    out = mla_prefill_attention(q, latents, w, nope_dim=N, scale=SCALE)  # CPU policy: blockwise "xla"
    assert rel(out, numpy_attention(q, latents, w, 0, None)) <= TOL
    assert list(IMPLEMENTATIONS) == ["cudnn", "cudnn_chunk", "cudnn_masked", "xla"]
    with pytest.raises(NotImplementedError, match="runs on"):
        mla_prefill_attention(q, latents, w, nope_dim=N, scale=SCALE, implementation="cudnn")
    # A 128K-token whole prompt needs no mask; an 8192-token chunk over a 128K cache a 2^30-element one.
    k3 = dict(cached=False, left_padding=False, segments=False, context_split=False, dtype=jnp.bfloat16, qk_dim=192,
              mask_elements=(1 << 17) ** 2, expanded_bytes=(1 << 17) * 96 * 2 * 192 * 2)
    assert cudnn_supports(**k3) is None
    for flag in ("cached", "left_padding"):
        assert "cudnn_masked" in cudnn_supports(**{**k3, flag: True})
        assert cudnn_masked_supports(**{**k3, flag: True, "mask_elements": 8192 << 17}) is None
        assert "mask of" in cudnn_masked_supports(**{**k3, flag: True, "mask_elements": CUDNN_MAX_MASK_ELEMENTS + 1})
    chunk = {**k3, "cached": True, "mask_elements": 8192 << 17}
    # A chunk without left padding: two calls with cuDNN's own masks, no mask array, so no size bound.
    assert cudnn_chunk_supports(**{**chunk, "mask_elements": CUDNN_MAX_MASK_ELEMENTS * 8}) is None
    assert "'cudnn'" in cudnn_chunk_supports(**k3)
    assert "cudnn_masked" in cudnn_chunk_supports(**{**chunk, "left_padding": True})
    for supports, problem_ in ((cudnn_supports, k3), (cudnn_chunk_supports, chunk), (cudnn_masked_supports, chunk)):
        assert "documents" in supports(**{**problem_, "segments": True})
        assert "context mesh axis" in supports(**{**problem_, "context_split": True})
        assert "bf16" in supports(**{**problem_, "dtype": jnp.float32})
        assert "head sizes" in supports(**{**problem_, "qk_dim": 576})
    # One call expands all S positions; the chunk's past runs in bounded blocks, so any cache length.
    for supports, problem_ in ((cudnn_supports, k3), (cudnn_masked_supports, chunk)):
        assert "expanded keys" in supports(**{**problem_, "expanded_bytes": CUDNN_MAX_EXPANDED_BYTES + 1})
    assert cudnn_chunk_supports(**{**chunk, "expanded_bytes": CUDNN_MAX_EXPANDED_BYTES * 4}) is None


@pytest.mark.parametrize("attend", [naive_mla_attention, BLOCKWISE, mla_prefill_attention])
def test_packed_documents_see_only_their_own_keys(attend):
    """Segment ids (packed training rows): documents 1, 2, 3 and trailing padding 0, across blocks."""
    q, latents, w = problem(13, 13)
    segments = jnp.asarray([[1] * 4 + [2] * 6 + [3] * 3, [1] * 9 + [0] * 4], jnp.int32)
    out = attend(q=q, latents=latents, w_kv_b=w, nope_dim=N, scale=SCALE, segment_ids=segments)
    assert rel(out, numpy_attention(q, latents, w, 0, None, segments)) <= TOL
    with pytest.raises(ValueError, match="whole cache-free sequence"):
        mla_prefill_attention(q[:, 1:], latents, w, nope_dim=N, scale=SCALE, q_offset=1, segment_ids=segments)


@pytest.mark.parametrize("change,match", [
    (lambda q, lat, w: (q[0], lat, w), "expected q"),
    (lambda q, lat, w: (q, lat[..., :-1], w), "do not match"),
    (lambda q, lat, w: (q, lat, w[:-1]), "heads"),
    (lambda q, lat, w: (q, lat[:, :3], w), "latent positions"),
])
def test_bad_inputs_name_the_problem(change, match):
    with pytest.raises(ValueError, match=match):
        mla_prefill_attention(*change(*problem(5, 5)), nope_dim=N, scale=SCALE)


def test_gpu_policy_picks_per_problem(monkeypatch):
    """On the GPU: whole prompts on cuDNN's causal mask, chunks on the two-call merge, left-padded rows
    on the masked call while its mask is small enough, the blockwise op for the rest."""
    monkeypatch.setattr(dispatch, "current_platform", lambda: "gpu")
    base = dict(cached=False, left_padding=False, segments=False, context_split=False, dtype=jnp.bfloat16,
                qk_dim=192, mask_elements=8192 << 17, expanded_bytes=(1 << 17) * 96 * 2 * 192 * 2)
    cases = [({}, "cudnn"), ({"cached": True}, "cudnn_chunk"), ({"left_padding": True}, "cudnn_masked"),
             ({"cached": True, "left_padding": True}, "cudnn_masked"),
             ({"left_padding": True, "mask_elements": CUDNN_MAX_MASK_ELEMENTS + 1}, "xla"),
             ({"cached": True, "expanded_bytes": CUDNN_MAX_EXPANDED_BYTES + 1}, "cudnn_chunk"),
             ({"expanded_bytes": CUDNN_MAX_EXPANDED_BYTES + 1}, "xla"),
             ({"segments": True}, "xla"), ({"cached": True, "context_split": True}, "xla"),
             ({"cached": True, "dtype": jnp.float32}, "xla")]
    for change, name in cases:
        assert dispatch.choose("mla_prefill_attention", IMPLEMENTATIONS, None, **{**base, **change}).name == name
