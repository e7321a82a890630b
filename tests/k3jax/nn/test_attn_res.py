"""Block Attention Residuals: the mix and the block schedule against independent float64 references.

Reference semantics (k3-architecture.md §2, golden README §7): keys are the RMS-normalised sources
without gain, the score vector is `res_norm.weight * res_proj.weight`, softmax over sources, the
mix uses the raw sources. Schedule (HF `_forward_attn_residual`): a Python list of completed
blocks plus a running prefix; the pre-mixer mix is skipped at layer 0; at layer % S == 0 the
prefix is pushed (and becomes None) after the pre-mixer mix and before the mixer.
"""

from __future__ import annotations

import dataclasses

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from k3jax.config import K3Config  # noqa: E402
from k3jax.nn.attn_res import AttnResStream, attn_res_mix  # noqa: E402

EPS = 1e-5
from tests.conftest import GOLDEN_DIR as GOLDEN  # noqa: E402


def np_mix(sources: list[np.ndarray], query: np.ndarray, key_norm: np.ndarray, eps: float = EPS) -> np.ndarray:
    """float64 AttnRes over a list of [..., D] sources."""
    v = np.stack([np.asarray(s, np.float64) for s in sources])  # [S, ..., D]
    keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    logits = keys @ (np.asarray(key_norm, np.float64) * np.asarray(query, np.float64))  # [S, ...]
    logits = logits - logits.max(axis=0, keepdims=True)
    w = np.exp(logits)
    w = w / w.sum(axis=0, keepdims=True)
    return np.sum(w[..., None] * v, axis=0)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# attn_res_mix tolerance: fp32 mean-of-squares and dot products over D <= 64 terms, a softmax over
# logits of size O(5) (exp amplifies absolute logit error by |z|), and a weighted sum of <= 7
# sources: all ~1e-6 relative to the source scale; 1e-5 of max|ref| gives a ~10x margin.
MIX_TOL = 1e-5


def make_stream(rng, rows: int, filled: int, shape=(2, 3, 64), garbage: float | None = None):
    bank = rng.standard_normal((rows, *shape)) * rng.uniform(0.5, 3.0, (rows, 1, 1, 1))
    if garbage is not None:
        bank[filled:] = garbage * np.sign(rng.standard_normal((rows - filled, *shape)))
    else:
        bank[filled:] = 0.0
    prefix = 2.0 * rng.standard_normal(shape)
    stream = AttnResStream(
        jnp.asarray(bank, jnp.float32), jnp.asarray(filled, jnp.int32), jnp.asarray(prefix, jnp.float32)
    )
    return stream, [bank[i] for i in range(filled)] + [prefix]


mix_jit = jax.jit(attn_res_mix, static_argnums=(3,))


@pytest.mark.parametrize("filled", [0, 1, 3, 6])
def test_mix_matches_numpy(filled: int) -> None:
    rng = np.random.default_rng(filled)
    d = 64
    stream, sources = make_stream(rng, 6, filled, (2, 3, d))
    query = 0.4 * rng.standard_normal(d)  # logits ~ N(0, d * 0.16 * E[gain^2]) -> O(3-5): peaked, not one-hot
    gain = rng.uniform(0.2, 2.0, d)  # non-trivial gain: catches a gain applied to values or dropped from keys
    out = mix_jit(stream, jnp.asarray(query, jnp.float32), jnp.asarray(gain, jnp.float32), EPS)
    assert out.shape == (2, 3, d) and out.dtype == jnp.float32
    ref = np_mix(sources, query, gain)
    assert rel(out, ref) <= MIX_TOL
    if filled == 0:
        # A single source: the mix is exactly that source (softmax of one logit is 1).
        np.testing.assert_array_equal(np.asarray(out), np.asarray(stream.prefix))
    else:
        # The weights are genuinely non-uniform, so the query/gain path is exercised.
        assert rel(ref, np_mix(sources, np.zeros(d), gain)) > 1e-2


def test_mix_zero_query_is_uniform_average() -> None:
    """Zero-initialised pseudo-query (the training init): a uniform average of the valid sources."""
    rng = np.random.default_rng(11)
    stream, sources = make_stream(rng, 5, 3, (1, 4, 32))
    out = attn_res_mix(stream, jnp.zeros(32), jnp.ones(32), EPS)
    assert rel(out, np.mean(np.stack(sources), axis=0)) <= MIX_TOL


@pytest.mark.parametrize("filled", [0, 2, 4])
def test_unfilled_bank_rows_are_masked(filled: int) -> None:
    """Huge garbage in unused bank rows must get zero weight and leave the output unchanged."""
    d = 32
    rng = np.random.default_rng(100 + filled)
    clean, sources = make_stream(rng, 5, filled, (2, 2, d))
    dirty = clean._replace(bank=clean.bank.at[filled:].set(
        jnp.asarray(1e30 * np.sign(rng.standard_normal((5 - filled, 2, 2, d))), jnp.float32)
    ))
    query = jnp.asarray(0.5 * rng.standard_normal(d), jnp.float32)
    gain = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    out_clean = np.asarray(mix_jit(clean, query, gain, EPS))
    out_dirty = np.asarray(mix_jit(dirty, query, gain, EPS))
    assert np.all(np.isfinite(out_dirty))
    # Masked rows contribute weight exactly 0 (exp(-inf)), so the result is bit-identical.
    np.testing.assert_array_equal(out_dirty, out_clean)
    assert rel(out_dirty, np_mix(sources, np.asarray(query), np.asarray(gain))) <= MIX_TOL


def test_mix_bfloat16_stream_returns_bfloat16() -> None:
    rng = np.random.default_rng(7)
    stream, _ = make_stream(rng, 3, 2, (1, 2, 32))
    stream = AttnResStream(stream.bank.astype(jnp.bfloat16), stream.num_blocks, stream.prefix.astype(jnp.bfloat16))
    sources = [np.asarray(stream.bank[i], np.float64) for i in range(2)] + [np.asarray(stream.prefix, np.float64)]
    q = rng.standard_normal(32) * 0.4
    out = attn_res_mix(stream, jnp.asarray(q, jnp.bfloat16), jnp.ones(32, jnp.bfloat16), EPS)
    assert out.dtype == jnp.bfloat16
    q_bf16 = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)
    # fp32 inside, one final bf16 rounding: <= 2^-8 relative to the source scale, plus slack.
    assert rel(out, np_mix(sources, q_bf16, np.ones(32))) <= 1e-2


# ---- the schedule --------------------------------------------------------------------------------

D_TOY = 16


class ToyModel:
    """Per-layer sublayers f(x) = tanh(x W) * 1.5 and per-site AttnRes weights, all float64 numpy."""

    def __init__(self, num_layers: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        d = D_TOY
        self.w_mixer = rng.standard_normal((num_layers, d, d)) / np.sqrt(d)
        self.w_ffn = rng.standard_normal((num_layers, d, d)) / np.sqrt(d)
        # Every site has its own random query and gain, layer 0's pre-mixer pair included (HF skips it).
        self.q_att = 0.5 * rng.standard_normal((num_layers, d))
        self.n_att = rng.uniform(0.5, 1.5, (num_layers, d))
        self.q_mlp = 0.5 * rng.standard_normal((num_layers, d))
        self.n_mlp = rng.uniform(0.5, 1.5, (num_layers, d))
        self.q_out = 0.5 * rng.standard_normal(d)
        self.n_out = rng.uniform(0.5, 1.5, d)
        self.embeddings = rng.standard_normal((2, 3, d))

    @staticmethod
    def sublayer(x, w, xp=np):
        return 1.5 * xp.tanh(x @ w)


def hf_schedule(m: ToyModel, num_layers: int, block: int) -> tuple[np.ndarray, int]:
    """Independent list-based transcription of HF `_forward_attn_residual` (float64)."""
    blocks: list[np.ndarray] = []
    prefix: np.ndarray | None = m.embeddings
    for layer in range(num_layers):
        if blocks:
            x_att = np_mix(blocks + [prefix], m.q_att[layer], m.n_att[layer])
        else:
            x_att = prefix  # only layer 0: the pre-mixer site is skipped
        if layer % block == 0:
            blocks.append(prefix)
            prefix = None
        a = m.sublayer(x_att, m.w_mixer[layer])
        prefix = a if prefix is None else prefix + a
        x_ffn = np_mix(blocks + [prefix], m.q_mlp[layer], m.n_mlp[layer])
        prefix = prefix + m.sublayer(x_ffn, m.w_ffn[layer])
    return np_mix(blocks + [prefix], m.q_out, m.n_out), len(blocks)


def f32(a) -> jax.Array:
    return jnp.asarray(a, jnp.float32)


def stream_layer(stream: AttnResStream, layer, block: int, wm, wf, qa, na, qm, nm) -> AttnResStream:
    """One layer driven exactly as DecoderLayer.__call__ drives the stream."""
    x = attn_res_mix(stream, qa, na, EPS)
    stream = stream.push_block_if(layer % block == 0)
    stream = stream.add(ToyModel.sublayer(x, wm, jnp))
    x = attn_res_mix(stream, qm, nm, EPS)
    return stream.add(ToyModel.sublayer(x, wf, jnp))


def k3jax_unrolled(m: ToyModel, num_layers: int, block: int, bank_rows: int) -> AttnResStream:
    stream = AttnResStream.start(f32(m.embeddings), bank_rows)
    for layer in range(num_layers):  # python-int layer index, as in the model's unrolled head/tail
        stream = stream_layer(
            stream, layer, block, f32(m.w_mixer[layer]), f32(m.w_ffn[layer]), f32(m.q_att[layer]),
            f32(m.n_att[layer]), f32(m.q_mlp[layer]), f32(m.n_mlp[layer]),
        )
    return stream


@jax.jit(static_argnums=(2, 3))
def _scan_stream(embeddings, xs, block: int, bank_rows: int) -> AttnResStream:
    def step(stream, xs):
        layer, *weights = xs
        return stream_layer(stream, layer, block, *weights), None

    stream, _ = jax.lax.scan(step, AttnResStream.start(embeddings, bank_rows), xs)
    return stream


def k3jax_scanned(m: ToyModel, num_layers: int, block: int, bank_rows: int) -> AttnResStream:
    """The same with a traced layer index under lax.scan, as in the model's scanned groups."""
    xs = (jnp.arange(num_layers), f32(m.w_mixer), f32(m.w_ffn), f32(m.q_att), f32(m.n_att), f32(m.q_mlp), f32(m.n_mlp))
    return _scan_stream(f32(m.embeddings), xs, block, bank_rows)


# Schedule tolerance: up to 13 layers x (2 fp32 sublayers + 2 mixes) on O(1) values; each stage adds
# ~1e-7 relative error and the tanh maps / softmax mixes are contractive-ish, so accumulated error is
# ~1e-6 of the output scale. 2e-5 leaves margin while any schedule mistake (a wrong push time, a
# wrongly applied layer-0 mix, a missing source) changes the output by O(1e-2) or more (checked below).
SCHEDULE_TOL = 2e-5


@pytest.mark.parametrize("block", [1, 3, 12])
@pytest.mark.parametrize("num_layers", [1, 5, 13])
def test_schedule_matches_hf_list_implementation(num_layers: int, block: int) -> None:
    cfg = K3Config.from_hf(GOLDEN, dtype="float32")
    cfg = dataclasses.replace(
        cfg, num_hidden_layers=num_layers, mixer_kinds=("kda",) * num_layers, attn_res_block_size=block
    )
    m = ToyModel(num_layers, seed=1000 * num_layers + block)
    ref, pushes = hf_schedule(m, num_layers, block)
    assert cfg.num_attn_res_blocks == pushes

    q_out, n_out = f32(m.q_out), f32(m.n_out)
    for driver in (k3jax_unrolled, k3jax_scanned):
        stream = driver(m, num_layers, block, cfg.num_attn_res_blocks)
        assert int(stream.num_blocks) == pushes  # the bank is filled exactly, never overflowing
        out = attn_res_mix(stream, q_out, n_out, EPS)
        assert rel(out, ref) <= SCHEDULE_TOL, (driver, rel(out, ref))


def test_schedule_reference_is_sensitive() -> None:
    """Plausible schedule mistakes move the output far beyond SCHEDULE_TOL, so the test above bites."""
    num_layers, block = 13, 3
    m = ToyModel(num_layers, seed=7)
    ref, _ = hf_schedule(m, num_layers, block)

    def variant(push_after_mixer: bool = False, push_offset: int = 0, mix_at_layer0: bool = False):
        blocks, prefix = [], m.embeddings
        for layer in range(num_layers):
            push = (layer + push_offset) % block == 0
            x = np_mix(blocks + [prefix], m.q_att[layer], m.n_att[layer]) if (blocks or mix_at_layer0) else prefix
            if push and not push_after_mixer:
                blocks.append(prefix)
                prefix = None
            a = m.sublayer(x, m.w_mixer[layer])
            prefix = a if prefix is None else prefix + a
            if push and push_after_mixer:
                blocks.append(prefix)
                prefix = None
            srcs = blocks + ([prefix] if prefix is not None else [])
            m_out = m.sublayer(np_mix(srcs, m.q_mlp[layer], m.n_mlp[layer]), m.w_ffn[layer])
            prefix = m_out if prefix is None else prefix + m_out
        return np_mix(blocks + [prefix], m.q_out, m.n_out)

    assert rel(variant(), ref) == 0.0  # the variant generator reproduces the reference when unperturbed
    assert rel(variant(push_after_mixer=True), ref) > 1e-3
    assert rel(variant(push_offset=1), ref) > 1e-3
    # With a single source the layer-0 mix is the identity, so "always mix" is equivalent (§2.8).
    assert rel(variant(mix_at_layer0=True), ref) < 1e-12


# ---- the real model follows the same schedule ----------------------------------------------------

def test_model_taps_follow_hf_schedule(tiny_built) -> None:
    """Run the jitted tiny model (unrolled head, scanned groups, unrolled tail) with taps, then replay
    the HF list schedule in float64 with the model's own sublayer outputs (attn_out, mlp_out) and
    AttnRes weights: every pre-mixer / pre-FFN mix and the output mix must match. This checks the
    schedule as DecoderLayer and run_model implement it, independently of the mixers' correctness."""
    from k3jax.model import forward

    model, _, cfg = tiny_built
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 3)), jnp.int32)
    out = forward(model, ids, collect_taps=True)
    taps = out.taps
    assert len(taps) == cfg.num_hidden_layers

    def w(linear):  # [1, D] pseudo-query -> [D]
        return np.asarray(linear.weight[...], np.float64)[0]

    def g(norm):
        return np.asarray(norm.weight[...], np.float64)

    blocks: list[np.ndarray] = []
    prefix = np.asarray(model.embed_tokens.weight[...], np.float64)[np.asarray(ids)]
    worst = 0.0
    for layer in range(cfg.num_hidden_layers):
        lay, tap = model.layer(layer), taps[layer]
        x_att = np_mix(blocks + [prefix], w(lay.self_attention_res_proj), g(lay.self_attention_res_norm)) if blocks else prefix
        worst = max(worst, rel(tap.attn_in, x_att))
        if layer % cfg.attn_res_block_size == 0:
            blocks.append(prefix)
            prefix = None
        a = np.asarray(tap.attn_out, np.float64)
        prefix = a if prefix is None else prefix + a
        x_ffn = np_mix(blocks + [prefix], w(lay.mlp_res_proj), g(lay.mlp_res_norm))
        worst = max(worst, rel(tap.mlp_in, x_ffn))
        prefix = prefix + np.asarray(tap.mlp_out, np.float64)
    final = np_mix(blocks + [prefix], w(model.output_attn_res_proj), g(model.output_attn_res_norm))
    worst = max(worst, rel(out.final_attn_res, final))
    assert len(blocks) == cfg.num_attn_res_blocks == 5  # pushes at layers 0, 3, 6, 9, 12
    # Each check is one fp32 mix over <= 6 sources of fp32 sums of the same tapped values: ~1e-6.
    assert worst <= MIX_TOL, worst

