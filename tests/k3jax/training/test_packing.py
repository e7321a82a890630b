"""Packed documents: each document in a packed row computes what it computes alone (fp32).

Documents of 70, 50 and 30 tokens cross the KDA chunk boundaries (64, 128) at different offsets,
so the state reset inside a chunk, across chunks and the conv window reset are all exercised; MLA
layers must block attention across documents. "Alone" is each document as its own unpacked row
(right-padded: padding after a document cannot reach it, everything is causal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import run_model
from pallas_kernels.kda import chunk_kda_fused
from tests.k3jax.training.small_k3 import small_model

LENGTHS = (70, 50, 30)


def test_packed_row_equals_documents_alone():
    model = small_model()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 512, n) for n in LENGTHS]
    pad = 12
    packed = np.concatenate([*docs, np.full(pad, 7)])[None].astype(np.int32)
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(LENGTHS)] + [np.zeros(pad)])[None].astype(np.int32)
    alone = np.stack([np.pad(d, (0, max(LENGTHS) - len(d)), constant_values=3) for d in docs]).astype(np.int32)

    forward = jax.jit(lambda m, ids, seg: run_model(m, ids, segment_ids=seg)[0].logits)
    got = np.asarray(forward(model, jnp.asarray(packed), jnp.asarray(segments)))[0]
    want = np.asarray(jax.jit(lambda m, ids: run_model(m, ids)[0].logits)(model, jnp.asarray(alone)))
    offset = 0
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(got[offset : offset + n], want[i, :n], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        offset += n
    # Without segment ids the same row mixes documents: the check above can fail.
    mixed = np.asarray(forward(model, jnp.asarray(packed), jnp.ones_like(segments)))[0]
    assert np.abs(mixed[LENGTHS[0] : LENGTHS[0] + 5] - want[1, :5]).max() > 1e-2


def test_segmented_kda_matches_separate_sequences():
    """The XLA chunked KDA with traced segment ids equals running each stretch as its own sequence,
    including a nonzero initial state, which feeds the first stretch only."""
    rng = np.random.default_rng(1)
    T, H, K = 150, 2, 16
    x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v, g = x(1, T, H, K), x(1, T, H, K), x(1, T, H, K), x(1, T, H, K)
    beta, a_log, dt_bias, s0 = x(1, T, H), x(H), x(H * K), x(1, H, K, K)
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(LENGTHS)])[None].astype(np.int32)
    run = lambda sl, init, segs=None: chunk_kda_fused(  # noqa: E731
        q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], a_log, dt_bias, lower_bound=-5.0,
        initial_state=init, output_final_state=True, segment_ids=segs, implementation="xla")
    o, state = jax.jit(lambda s: run(slice(None), s0, s))(jnp.asarray(seg))
    offset = 0
    for i, n in enumerate(LENGTHS):
        o_i, state_i = run(slice(offset, offset + n), s0 if i == 0 else None)
        np.testing.assert_allclose(np.asarray(o[:, offset : offset + n]), np.asarray(o_i), rtol=1e-5, atol=1e-5)
        offset += n
    np.testing.assert_allclose(np.asarray(state), np.asarray(state_i), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["pallas_gpu", "mosaic_tpu"])
def test_segment_ids_run_on_xla_only(implementation):
    z = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(NotImplementedError, match="segment_ids"):
        chunk_kda_fused(z, z, z, z, z[..., 0], jnp.zeros(1), jnp.zeros(16), lower_bound=-5.0,
                        segment_ids=jnp.ones((1, 8), jnp.int32), implementation=implementation)
