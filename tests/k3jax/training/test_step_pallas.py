"""The training step's gradients through the Pallas paths (interpret mode on CPU): the KDA custom VJP
("pallas_gpu": GPU forward, analytic GPU backward) and the routed experts' custom VJP equal the XLA
reference's gradients on the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.training import TrainConfig, Trainer
from tests.k3jax.training.small_k3 import random_batch, small_model


def test_gradients_through_pallas_kernels_match_xla():
    batch = random_batch(1, 64, seed=4)  # one document per row: the fused KDA kernel runs
    loss_x, grads_x = Trainer(small_model(kernels={"kda": "xla", "moe": "xla"}), TrainConfig()).gradients(batch)
    pallas = small_model(kernels={"kda": "pallas_gpu", "moe": "pallas_gpu"})
    loss_p, grads_p = Trainer(pallas, TrainConfig()).gradients(batch)
    np.testing.assert_allclose(loss_p, loss_x, rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_x))
    for (path, gp), gx in zip(jax.tree_util.tree_leaves_with_path(grads_p), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(np.asarray(gp), np.asarray(gx), rtol=1e-4, atol=1e-4 * scale,
                                   err_msg=jax.tree_util.keystr(path))
    kda_grads = [g for p, g in jax.tree_util.tree_leaves_with_path(grads_p) if "A_log" in jax.tree_util.keystr(p)]
    assert kda_grads and all(float(jnp.abs(g).max()) > 0 for g in kda_grads)
