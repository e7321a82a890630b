"""The MLA latent cache split along the sequence over the `context` mesh axis (8 fake CPU devices):
chunked prefill into the split cache and decode steps from it give the unsharded logits, and decode
runs the shard_map path (`sharding.context_parallel_absorbed_attention`): one all-gather over
`context` per MLA layer in the compiled step, no other collective."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import k3jax
from k3jax.generate import _decode_step
from k3jax.nn.mla import GatedMLA, MLACache
from pallas_kernels.mla import absorbed_attention
from sharding import (
    ContextParallel, context_parallel_absorbed_attention, make_mesh, shard_batch, shard_cache, shard_model,
)
from tests.conftest import rel_rms

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def collectives(hlo: str) -> dict[str, list[str]]:
    """Each collective op of a compiled HLO text -> the lines that issue it."""
    lines = hlo.splitlines()
    return {op: [line for line in lines if re.search(rf"= \S+ {op}(-start)?\(", line)] for op in COLLECTIVES}


def test_context_split_cache_equals_unsharded(golden_model_fp32):
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 512, (1, 27)), jnp.int32)
    full = np.asarray(golden_model_fp32(ids))
    mesh = make_mesh("context=8")
    model = shard_model(golden_model_fp32, mesh)
    mla = [m for _, m in nnx.iter_modules(model) if isinstance(m, GatedMLA)]
    assert mla and all(m.context_parallel == ContextParallel(mesh, "context", ("data", "fsdp"), ("tensor",))
                       for m in mla)
    cache = shard_cache(model.empty_cache(1, 32), mesh)  # 32 positions: 4 per device
    for lo in range(0, 24, 8):  # the prompt in three chunks of 8
        last, cache = k3jax.extend(model, cache, shard_batch(ids[:, lo : lo + 8], mesh))
        assert rel_rms(last, full[:, lo + 7]) <= 1e-5
    for t in range(24, 27):  # device 7 (positions 28..31) holds no written position yet
        step, cache = k3jax.decode_step(model, cache, ids[:, t])
        assert rel_rms(step, full[:, t]) <= 1e-5, f"decode at {t}"
    latents = [c.latent for c in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, MLACache))
               if isinstance(c, MLACache)]
    assert latents and all(lat.sharding.shard_shape(lat.shape)[-2] == lat.shape[-2] // 8 for lat in latents)

    # The program decode_step ran (cached: no second compile). The MLA modules are the program's MLA
    # sites: unrolled layers once each, a scanned group's layers once for all its groups.
    found = collectives(_decode_step.lower(model, cache, ids[:, 26]).compile().as_text())
    assert len(found["all-gather"]) == len(mla), found["all-gather"]
    assert all("{'context'}" in line for line in found["all-gather"])
    assert not any(found[op] for op in COLLECTIVES if op != "all-gather"), found


@pytest.mark.parametrize("spec", ["context=8", "data=2,context=2,tensor=2"])
def test_wrapper_equals_single_device_with_left_padding(spec):
    """The shard_map op alone, jitted over a split cache (2 or 8 positions per device; rows over `data`
    and heads over `tensor` where the mesh has them): rows with left padding over whole shards and a
    query whose later shards are unwritten, against the unsplit absorbed attention projected by W_UV.
    Its one collective is the all-gather over `context`."""
    heads, rank, rope, value, seq = 4, 10, 4, 6, 16
    rng = np.random.default_rng(0)
    q_latent, q_pe, latents, w_uv = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                                     [(2, 1, heads, rank), (2, 1, heads, rope), (2, seq, rank + rope),
                                      (heads, value, rank)])
    start, position = jnp.asarray([0, 7], jnp.int32), jnp.asarray(9, jnp.int32)
    mesh = make_mesh(spec)
    latents = jax.device_put(latents, NamedSharding(mesh, P(None, "context", None)))
    setting = ContextParallel(mesh, "context", ("data", "fsdp"), ("tensor",))
    split = jax.jit(functools.partial(setting.attend, scale=0.3))

    got = split(q_latent, q_pe, latents, w_uv, position=position, start=start)
    want = jnp.einsum("bthr,hvr->bthv", absorbed_attention(q_latent, q_pe, latents, scale=0.3,
                                                           query_pos=position[None], start=start), w_uv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    found = collectives(split.lower(q_latent, q_pe, latents, w_uv, position=position, start=start).compile()
                        .as_text())
    assert len(found["all-gather"]) == 1 and "{'context'}" in found["all-gather"][0], found
    assert not any(found[op] for op in COLLECTIVES if op != "all-gather"), found
    with pytest.raises(ValueError, match=r"15 positions, not divisible by mesh axis 'context' of size "):
        context_parallel_absorbed_attention(q_latent, q_pe, latents[:, :15], w_uv, scale=0.3, position=position,
                                            start=start, mesh=mesh, axis="context")
