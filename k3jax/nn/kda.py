"""Kimi Delta Attention layer: gated delta-rule linear attention with a lower-bounded forget gate.

Data path (k3-architecture.md §6.2, kda.md §1): q/k/v projections -> depthwise causal conv (kernel
W, SiLU, fp32 weights) -> L2-normalised q, k -> per-channel log-decay
g = lb * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)) and beta = sigmoid(b_proj x), both fp32
-> KDA recurrence with an fp32 state -> per-head RMSNorm * sigmoid(g_proj x) -> o_proj.
The activations from the conv outputs and the gate / beta pre-activations on are the KDA op's
(`chunk_kda_fused`), so a kernel can fuse them; decode applies the same ones (`activate`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.nn.layers import F32, Linear, constant_init, declare, normal_init
from pallas_kernels.kda import activate, chunk_kda_fused, kda_decode


class KDACache(NamedTuple):
    state: jax.Array  # [B, H, K, V] fp32 recurrent state
    conv: jax.Array  # [B, W-1, 3P] last W-1 raw (pre-conv) q|k|v projections, activation dtype

    # Logical axes per field, read by `sharding` to place caches. The state's heads follow
    # `kda_heads` (split like the projections that update them); the conv tail holds the q|k|v
    # projections' last inputs, split along 3P like them.
    LOGICAL_AXES = {"state": ("activation_batch", "kda_heads", None, None), "conv": ("activation_batch", None, "kda_proj")}

    @classmethod
    def empty(cls, cfg: K3Config, batch: int, dtype: jnp.dtype) -> "KDACache":
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        return cls(
            state=jnp.zeros((batch, h, d, d), F32),
            conv=jnp.zeros((batch, cfg.kda_conv_kernel - 1, 3 * cfg.kda_proj_dim), dtype),
        )


class ShortConv(nnx.Module):
    """Depthwise causal convolution weight, stored [P, 1, W] in fp32 like the release."""

    def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs) -> None:
        self.weight = declare(rngs, (channels, 1, kernel), F32, ("kda_proj", None, None), normal_init(0.5))


def causal_conv_silu(
    x: jax.Array, weight: jax.Array, left: jax.Array, segments: jax.Array | None = None,
    real_tokens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """y[t] = silu(sum_j w[:, j] * x[t - W + 1 + j]) in fp32, with `left` the W-1 inputs before x.

    `segments` int32 [B, T] (packed documents): the window of token t sees only inputs with t's
    segment id (a document's first tokens see zeros, as when it runs alone).
    `real_tokens` (int32 scalar): only x[:, :real_tokens] are real, the rest right padding; the new
    left context then ends at the last real input.
    Returns the activation-dtype output and the new left context (last W-1 raw inputs).
    """
    width = weight.shape[-1]
    seq = x.shape[1]
    full = jnp.concatenate([left.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    w = weight[:, 0, :].astype(F32)  # [C, W]
    taps = [full[:, j : j + seq].astype(F32) * w[:, j] for j in range(width)]
    if segments is not None:
        seg_full = jnp.pad(segments, ((0, 0), (width - 1, 0)), mode="edge")
        taps = [jnp.where((seg_full[:, j : j + seq] == segments)[..., None], tap, 0.0) for j, tap in enumerate(taps)]
    y = sum(taps)
    tail = full[:, seq:] if real_tokens is None else jax.lax.dynamic_slice_in_dim(full, real_tokens, width - 1, 1)
    return jax.nn.silu(y).astype(x.dtype), tail


def gated_head_rms_norm(o: jax.Array, weight: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """FusedRMSNormGated: per-head RMSNorm x gain x sigmoid(gate), all fp32, result in o's dtype."""
    o32 = o.astype(F32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(F32) * jax.nn.sigmoid(gate.astype(F32))).astype(o.dtype)


class KimiDeltaAttention(nnx.Module):
    def __init__(self, cfg: K3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs, kernels: Kernels = Kernels()) -> None:
        d, p, h, k = cfg.hidden_size, cfg.kda_proj_dim, cfg.kda_num_heads, cfg.kda_head_dim
        proj_axes = ("kda_proj", "embed")
        self.q_proj = Linear(d, p, dtype=dtype, axes=proj_axes, rngs=rngs)
        self.k_proj = Linear(d, p, dtype=dtype, axes=proj_axes, rngs=rngs)
        self.v_proj = Linear(d, p, dtype=dtype, axes=proj_axes, rngs=rngs)
        self.q_conv1d = ShortConv(p, cfg.kda_conv_kernel, rngs=rngs)
        self.k_conv1d = ShortConv(p, cfg.kda_conv_kernel, rngs=rngs)
        self.v_conv1d = ShortConv(p, cfg.kda_conv_kernel, rngs=rngs)
        self.f_a_proj = Linear(d, k, dtype=dtype, axes=(None, "embed"), rngs=rngs)
        self.f_b_proj = Linear(k, p, dtype=dtype, axes=("kda_proj", None), rngs=rngs, gain=0.5)
        self.dt_bias = declare(rngs, (p,), F32, ("kda_proj",), normal_init(0.5))
        self.A_log = declare(
            rngs, (h,), F32, ("kda_heads",), lambda key, s, t: jnp.log(jax.random.uniform(key, s, t, 1.0, 16.0))
        )
        self.b_proj = Linear(d, h, dtype=dtype, axes=("kda_heads", "embed"), rngs=rngs)
        self.g_proj = Linear(d, p, dtype=dtype, axes=proj_axes, rngs=rngs)
        self.o_norm = _Gain(k, rngs=rngs)
        self.o_proj = Linear(p, d, dtype=dtype, axes=("embed", "kda_proj"), rngs=rngs, gain=0.5)
        self.num_heads, self.head_dim = h, k
        self.lower_bound, self.norm_eps = cfg.kda_gate_lower_bound, cfg.rms_norm_eps
        self.kernels = kernels  # static: which KDA implementations prefill and decode run

    def __call__(
        self, x: jax.Array, cache: KDACache | None = None, valid: jax.Array | None = None,
        segments: jax.Array | None = None, real_tokens: jax.Array | None = None,
    ) -> tuple[jax.Array, KDACache | None]:
        """x [B, T, D] (already input-normalised). With a cache, continues from it (T == 1: decode step).

        `segments` int32 [B, T] (packed documents, no cache): the state and the conv window reset
        wherever the id changes along a row, so each document computes what it would alone.

        `valid` bool [B, T] (False at left padding): pad steps are identities. Raw q/k/v are zeroed, so
        the conv windows of the first real tokens see zeros as in an unpadded run; the gate and beta
        pre-activations are -inf, which the KDA op turns into g = beta = 0 exactly (zero gradients),
        so the state is untouched.

        `real_tokens` (int32 scalar, with a cache): the first `real_tokens` of the T tokens are real and
        the rest right padding, to be marked invalid in `valid` too; the cached conv window then ends
        at the last real token, so the cache continues as if only the real tokens had run.
        """
        batch, seq, _ = x.shape
        h, k = self.num_heads, self.head_dim
        raw = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)  # [B, T, 3P]
        if valid is not None:
            raw = jnp.where(valid[..., None], raw, jnp.zeros((), raw.dtype))
        conv_weight = jnp.concatenate(
            [self.q_conv1d.weight[...], self.k_conv1d.weight[...], self.v_conv1d.weight[...]], axis=0
        )
        left = cache.conv if cache is not None else jnp.zeros((batch, conv_weight.shape[-1] - 1, raw.shape[-1]), x.dtype)
        if segments is not None and cache is not None:
            raise ValueError("segments (packed documents) are for cache-free passes; got a cache too")
        qkv, conv_tail = causal_conv_silu(raw, conv_weight, left, segments, real_tokens)
        q, key, v = (t.reshape(batch, seq, h, k) for t in jnp.split(qkv, 3, axis=-1))
        g_raw, beta_logits = self.gate_inputs(x)
        if valid is not None:
            g_raw = jnp.where(valid[..., None, None], g_raw, -jnp.inf)
            beta_logits = jnp.where(valid[..., None], beta_logits, -jnp.inf)
        A_log, dt_bias = self.A_log[...], self.dt_bias[...]

        if cache is not None and seq == 1:
            q, key, g, beta = activate(q[:, 0], key[:, 0], g_raw[:, 0], beta_logits[:, 0], A_log, dt_bias,
                                       lower_bound=self.lower_bound)
            o, state = kda_decode(q, key, v[:, 0], g, beta, cache.state, implementation=self.kernels.kda_decode)
            o = o[:, None]
        else:
            initial = cache.state if cache is not None else None
            o, state = chunk_kda_fused(
                q, key, v, g_raw, beta_logits, A_log, dt_bias, lower_bound=self.lower_bound,
                initial_state=initial, output_final_state=cache is not None, segment_ids=segments,
                implementation=self.kernels.kda,
            )

        gate = self.g_proj(x).reshape(batch, seq, h, k)
        o = gated_head_rms_norm(o, self.o_norm.weight[...], gate, self.norm_eps)
        out = self.o_proj(o.reshape(batch, seq, h * k))
        return out, (KDACache(state, conv_tail) if cache is not None else None)

    def gate_inputs(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gate pre-activation f_b(f_a(x)) [B, T, H, K] and the beta logits b_proj(x) [B, T, H], in the
        activation dtype; the KDA op activates them (fp32) with A_log, dt_bias and the lower bound."""
        batch, seq, _ = x.shape
        g_raw = self.f_b_proj(self.f_a_proj(x)).reshape(batch, seq, self.num_heads, self.head_dim)
        return g_raw, self.b_proj(x)


class _Gain(nnx.Module):
    """The fp32 per-head output-norm gain `o_norm.weight` [head_dim]."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs) -> None:
        self.weight = declare(rngs, (dim,), F32, (None,), constant_init(1.0))
