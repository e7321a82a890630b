"""LoRA on the routed experts: per-expert adapters on gate, up and down, dense and MXFP4-packed bases.

The adapted layer against a float64 per-token reference (each selected expert's SiTU-GLU with
W + s B A in place of W, weighted like the base combine) at 1e-5; B = 0 gives the base model bit for
bit; gradients reach exactly the experts some token chose; a `finetune` run with --lora-experts learns,
exports dense experts with the adapters folded in, and the export reloads to the adapter forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import k3jax
from k3jax.model import run_model
from k3jax.nn.moe import MXFP4Weight, PackedRoutedExperts, RoutedExperts
from k3jax.training import LoRARoutedExperts, Trainer, add_lora, naive_cross_entropy
from k3jax.training.checkpointing import RunCheckpoints
from k3jax.training.options import FinetuneOptions
from k3jax.training.run import _trainer_config, finetune
from pallas_kernels.moe import routed_experts
from pallas_kernels.mxfp4.codec import decode_mxfp4, encode_mxfp4
from tests.conftest import GOLDEN_DIR, rel_rms
from tests.k3jax.training.finetune_helpers import BATCH, SEQ_LEN, write_data
from tests.k3jax.training.small_k3 import random_batch, small_model

E, LATENT, INTER, RANK, ALPHA, N, K = 8, 32, 32, 4, 8.0, 12, 2
BETA, LINEAR_BETA = 4.0, 25.0
ROUTED = (0, 1, 2, 4, 5)  # experts 3, 6, 7 get no token


def _situ(g, u):
    return BETA * np.tanh(g / BETA) / (1.0 + np.exp(-g)) * LINEAR_BETA * np.tanh(u / LINEAR_BETA)


def _reference(x, dense: dict, lora: dict, weights, ids, scale: float) -> np.ndarray:
    """float64, token by token: sum_j weights[n, j] * E'_e(x[n]), E' with W_e x + s B_e A_e x everywhere."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x, weights = f(x), f(weights)
    out = np.zeros((x.shape[0], dense["w2"].shape[1]))
    for n in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids)[n]):
            proj = lambda name, v: f(dense[name][e]) @ v + scale * f(lora[name][1][e]) @ (f(lora[name][0][e]) @ v)  # noqa: E731,B023
            out[n] += weights[n, j] * proj("w2", _situ(proj("w1", x[n]), proj("w3", x[n])))
    return out


def _layer(packed: bool) -> tuple[LoRARoutedExperts, dict]:
    """Adapted experts over dense or MXFP4 bases (fp32), nonzero B; and the dense base weights (decoded)."""
    base = RoutedExperts(E, LATENT, INTER, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dense = {n: np.asarray(getattr(base, n)[...]) for n in ("w1", "w2", "w3")}
    if packed:
        base = nnx.eval_shape(lambda: PackedRoutedExperts(RoutedExperts(E, LATENT, INTER, dtype=jnp.float32,
                                                                        rngs=nnx.Rngs(0))))
        for n, w in dense.items():
            codes, scales = encode_mxfp4(w)
            setattr(base, n, MXFP4Weight(jnp.asarray(codes), jnp.asarray(scales), ("exp", None, None)))
            dense[n] = decode_mxfp4(codes, scales)
    layer = LoRARoutedExperts(base, rank=RANK, alpha=ALPHA, dropout=0.0, dtype=jnp.float32, key=jax.random.key(1))
    rng = np.random.default_rng(2)
    for n in ("w1", "w2", "w3"):
        b = getattr(layer, f"{n}_lora_b")
        b[...] = jnp.asarray(0.3 * rng.standard_normal(b.shape), jnp.float32)
    return layer, dense


def _inputs():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((N, LATENT)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(ROUTED)[:K] for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.2, 1.0, (N, K)), jnp.float32)
    return x, weights, ids


def _lora(layer) -> dict:
    return {n: (np.asarray(getattr(layer, f"{n}_lora_a")[...]), np.asarray(getattr(layer, f"{n}_lora_b")[...]))
            for n in ("w1", "w2", "w3")}


@pytest.mark.parametrize("packed", [False, True])
def test_adapter_forward_matches_per_token_reference_and_b0_is_base(packed):
    layer, dense = _layer(packed)
    x, weights, ids = _inputs()
    run = jax.jit(lambda m, x, w, i: m(x, w, i, beta=BETA, linear_beta=LINEAR_BETA))
    got = np.asarray(run(layer, x, weights, ids))
    want = _reference(x, dense, _lora(layer), weights, ids, ALPHA / RANK)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    base = routed_experts(x, *(jnp.asarray(dense[n]) for n in ("w1", "w2", "w3")), weights, ids, beta=BETA,
                          linear_beta=LINEAR_BETA, implementation="xla")
    assert not np.allclose(got, np.asarray(base), atol=1e-3)  # the adapters change the output
    for n in ("w1", "w2", "w3"):
        b = getattr(layer, f"{n}_lora_b")
        b[...] = jnp.zeros(b.shape, b.dtype)
    np.testing.assert_array_equal(np.asarray(run(layer, x, weights, ids)), np.asarray(base))


def test_gradients_reach_exactly_the_routed_experts():
    layer, _ = _layer(packed=True)
    x, weights, ids = _inputs()
    cot = jnp.asarray(np.random.default_rng(4).standard_normal((N, LATENT)), jnp.float32)
    graphdef, lora, rest = nnx.split(layer, nnx.LoRAParam, ...)

    def loss(lora):
        out = nnx.merge(graphdef, lora, rest)(x, weights, ids, beta=BETA, linear_beta=LINEAR_BETA)
        return jnp.sum(out * cot)

    grads = jax.grad(loss)(lora)
    for name, g in jax.tree_util.tree_leaves_with_path(grads):
        per_expert = np.abs(np.asarray(g)).reshape(E, -1).max(-1)
        assert np.all(per_expert[list(ROUTED)] > 0), (jax.tree_util.keystr(name), per_expert)
        assert np.all(per_expert[[3, 6, 7]] == 0), (jax.tree_util.keystr(name), per_expert)


def test_b0_model_is_the_base_model_and_only_adapters_train():
    model = small_model()
    ids = jnp.asarray((np.arange(16, dtype=np.int32)[None] * 37) % 512)
    forward = jax.jit(lambda m, ids: run_model(m, ids)[0].logits)
    base = np.asarray(forward(model, ids))
    adapted = nnx.merge(*nnx.split(model))
    names = add_lora(adapted, rank=RANK, alpha=ALPHA, dropout=0.0, targets=("*.experts",), seed=0)
    assert names and all(n.endswith("block_sparse_moe.experts") for n in names)
    np.testing.assert_array_equal(np.asarray(forward(adapted, ids)), base)
    trained = Trainer(small_model(), _trainer_config(FinetuneOptions(lora_rank=2, lora_experts=True))).trainable_names
    assert any(".experts.w2_lora_b" in n for n in trained) and all("lora_" in n for n in trained)


@pytest.fixture(scope="module")
def expert_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expert_lora")
    data = write_data(tmp / "data.jsonl")
    options = dict(steps=3, batch_size=BATCH, seq_len=SEQ_LEN, learning_rate=1e-2, lora_rank=4, lora_alpha=8.0,
                   lora_experts=True, save_every=3, progress=False)
    return finetune(GOLDEN_DIR, data, tmp / "out", **options), options


def test_expert_lora_run_learns_and_export_reloads_to_the_adapter_forward(expert_run):
    result, options = expert_run
    losses = [r["loss"] for r in result.metrics]
    assert losses[-1] < losses[0], losses
    experts = {}
    for f in result.final.glob("*.safetensors"):
        experts.update({k: v for k, v in load_file(str(f)).items() if ".experts." in k})
    assert experts and all(k.endswith(".weight") and v.dtype == ml_dtypes.bfloat16 for k, v in experts.items())
    # The adapter forward: the run's last checkpoint over the packed base, as the run trained it.
    trainer = Trainer(k3jax.from_pretrained(GOLDEN_DIR, dtype="float32", experts="mxfp4"),
                      _trainer_config(FinetuneOptions(**options)))
    assert any(".experts.w1_lora_a" in n for n in trainer.trainable_names)
    checkpoints = RunCheckpoints(result.out / "checkpoints")
    trainer.restore(checkpoints.restore(3, trainer.state())[0])
    checkpoints.close()
    batch = random_batch(1, 24, seed=5)
    merged = trainer.merged_model()
    assert not any(isinstance(m, LoRARoutedExperts) for _, m in nnx.iter_modules(merged))
    want = np.asarray(merged(batch.input_ids))
    sums = naive_cross_entropy(jnp.asarray(want).reshape(-1, want.shape[-1]), batch.targets.reshape(-1),
                               batch.loss_mask.reshape(-1))
    np.testing.assert_allclose(float(sums.nll / sums.tokens), trainer.eval_loss(batch), rtol=1e-5)
    got = np.asarray(k3jax.from_pretrained(result.final, dtype="float32")(batch.input_ids))
    base = np.asarray(k3jax.from_pretrained(GOLDEN_DIR, dtype="float32")(batch.input_ids))
    # the export rounds the merged weights to bf16 once; training moved the model much further
    assert rel_rms(got, want) < 1e-2 < rel_rms(base, want), (rel_rms(got, want), rel_rms(base, want))
