"""The MLA latent cache split along the sequence over the `context` mesh axis (8 fake CPU devices):
chunked prefill into the split cache and decode steps from it give the unsharded logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax.nn.mla import MLACache
from sharding import make_mesh, shard_batch, shard_cache, shard_model
from tests.conftest import rel_rms


def test_context_split_cache_equals_unsharded(golden_model_fp32):
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 512, (1, 27)), jnp.int32)
    full = np.asarray(golden_model_fp32(ids))
    mesh = make_mesh("context=8")
    model = shard_model(golden_model_fp32, mesh)
    cache = shard_cache(model.empty_cache(1, 32), mesh)  # 32 positions: 4 per device
    for lo in range(0, 24, 8):  # the prompt in three chunks of 8
        last, cache = k3jax.extend(model, cache, shard_batch(ids[:, lo : lo + 8], mesh))
        assert rel_rms(last, full[:, lo + 7]) <= 1e-5
    for t in range(24, 27):
        step, cache = k3jax.decode_step(model, cache, ids[:, t])
        assert rel_rms(step, full[:, t]) <= 1e-5, f"decode at {t}"
    latents = [c.latent for c in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, MLACache))
               if isinstance(c, MLACache)]
    assert latents and all(lat.sharding.shard_shape(lat.shape)[-2] == lat.shape[-2] // 8 for lat in latents)
