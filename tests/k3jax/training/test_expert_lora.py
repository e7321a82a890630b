"""LoRA on the routed experts: per-expert adapters on gate, up and down, dense and MXFP4-packed bases.

The adapted layer against a float64 per-token reference (each selected expert's SiTU-GLU with
W x + s B A x in place of W x, weighted like the base combine) at 1e-5, and its merged experts likewise;
B = 0 gives the base layer and model bit for bit; gradients reach exactly the experts some token chose;
expert parallelism is refused; a `finetune` run with --lora-experts over the packed golden experts learns
and exports its merged model (dense bf16 experts), which reloads weight for weight."""

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
from k3jax.nn.moe import MXFP4Weight, PackedRoutedExperts, RoutedExperts, RouterBias
from k3jax.tokenizer import load_tokenizer
from k3jax.training import LoRARoutedExperts, Trainer, add_lora
from k3jax.training.checkpointing import RunCheckpoints
from k3jax.training.data import PackedBatches, read_documents, split_documents
from k3jax.training.optim import path_name
from k3jax.training.options import FinetuneOptions
from k3jax.training.run import _batch, _trainer_config, finetune
from pallas_kernels.moe import routed_experts
from pallas_kernels.mxfp4.codec import decode_mxfp4, encode_mxfp4
from sharding import make_mesh, shard_model
from tests.conftest import GOLDEN_DIR
from tests.k3jax.training.finetune_helpers import BATCH, SEQ_LEN, write_data
from tests.k3jax.training.small_k3 import small_model

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
            def proj(name, v, e=e):
                return f(dense[name][e]) @ v + scale * f(lora[name][1][e]) @ (f(lora[name][0][e]) @ v)
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
    merged = layer.merged()  # dense W + s B A per expert, in fp32 here
    assert isinstance(merged, RoutedExperts)
    folded = routed_experts(x, merged.w1[...], merged.w2[...], merged.w3[...], weights, ids, beta=BETA,
                            linear_beta=LINEAR_BETA, implementation="xla")
    assert np.abs(np.asarray(folded) - want).max() <= 1e-5 * np.abs(want).max()
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


def test_dropout_masks_the_adapter_inputs_only_in_training():
    layer, dense = _layer(packed=False)
    dropped = LoRARoutedExperts(RoutedExperts(E, LATENT, INTER, dtype=jnp.float32, rngs=nnx.Rngs(0)), rank=RANK,
                                alpha=ALPHA, dropout=0.5, dtype=jnp.float32, key=jax.random.key(1))
    nnx.update(dropped, nnx.state(layer, nnx.LoRAParam))
    dropped.dropout_key[...] = jax.random.key_data(jax.random.key(7))
    x, weights, ids = _inputs()
    run = lambda m: np.asarray(m(x, weights, ids, beta=BETA, linear_beta=LINEAR_BETA))  # noqa: E731
    want = _reference(x, dense, _lora(layer), weights, ids, ALPHA / RANK)
    assert np.abs(run(dropped) - want).max() > 1e-2 * np.abs(want).max()  # training: adapter inputs dropped
    dropped.deterministic = True
    assert np.abs(run(dropped) - want).max() <= 1e-5 * np.abs(want).max()


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
    options = dict(steps=2, batch_size=BATCH, seq_len=SEQ_LEN, learning_rate=1e-2, lora_rank=4, lora_alpha=8.0,
                   lora_experts=True, save_every=2, seed=0, progress=False)
    return finetune(GOLDEN_DIR, data, tmp / "out", **options), options, data


def test_expert_lora_refuses_expert_parallelism():
    mesh = make_mesh("expert=8")
    config = _trainer_config(FinetuneOptions(lora_rank=2, lora_experts=True))
    with pytest.raises(ValueError, match=r"TrainConfig.lora_targets: LoRA on the routed experts \('\*.experts'\) "
                                         r"does not run expert-parallel"):
        Trainer(small_model(), config, mesh=mesh)
    adapted = small_model()
    add_lora(adapted, rank=2, alpha=ALPHA, dropout=0.0, targets=("*.experts",), seed=0)
    sharded = shard_model(adapted, mesh)  # outside the Trainer: the layer itself refuses
    with pytest.raises(ValueError, match="does not run expert-parallel; use a mesh without an 'expert' axis"):
        sharded(jnp.zeros((1, 8), jnp.int32))


def test_expert_lora_run_learns_and_exports_the_merged_experts_dense(expert_run):
    result, options, data = expert_run
    experts = {}
    for f in result.final.glob("*.safetensors"):
        experts.update({k: v for k, v in load_file(str(f)).items() if ".experts." in k})
    assert experts and all(k.endswith(".weight") and v.dtype == ml_dtypes.bfloat16 for k, v in experts.items())
    # The adapted model: the run's last checkpoint over the packed base, as the run trained it.
    trainer = Trainer(k3jax.from_pretrained(GOLDEN_DIR, dtype="float32", experts="mxfp4"),
                      _trainer_config(FinetuneOptions(**options)))
    assert any(".experts.w1_lora_a" in n for n in trainer.trainable_names)
    pieces = split_documents(read_documents(data, load_tokenizer(GOLDEN_DIR), vocab_size=512), SEQ_LEN)
    batch = _batch(next(PackedBatches(pieces, batch_size=BATCH, seq_len=SEQ_LEN, seed=options["seed"])))
    before = trainer.eval_loss(batch)  # B = 0: the base model
    checkpoints = RunCheckpoints(result.out / "checkpoints")
    trainer.restore(checkpoints.restore(options["steps"], trainer.state())[0])
    checkpoints.close()
    after = trainer.eval_loss(batch)  # the run's first batch, after its steps
    assert after < before - 0.1, (before, after)
    merged, golden = trainer.merged_model(), k3jax.from_pretrained(GOLDEN_DIR, dtype="float32")
    assert not any(isinstance(m, LoRARoutedExperts) for _, m in nnx.iter_modules(merged))
    # The export reloads to the merged model (whose forward is the adapters', see above) with every
    # weight rounded once to the release's bf16; the trained experts moved off their MXFP4 base.
    reloaded = k3jax.from_pretrained(result.final, dtype="float32")
    def leaves(model) -> dict:
        state = nnx.to_pure_dict(nnx.state(model, (nnx.Param, RouterBias)))
        return {path_name(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}

    want, got, base = leaves(merged), leaves(reloaded), leaves(golden)
    experts = [n for n in want if ".experts.w" in n]
    assert want.keys() == got.keys() and experts, sorted(want)[:5]
    for name, w in want.items():
        if not np.array_equal(got[name], w):  # fp32 in the release (A_log, router bias, ...) else bf16
            np.testing.assert_array_equal(got[name], w.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name)
    for name in experts:
        assert not np.array_equal(got[name], base[name]), name
