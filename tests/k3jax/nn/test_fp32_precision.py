"""An fp32 model asks for full-precision matmuls itself: on GPUs, XLA runs an fp32 dot at its default
precision as TF32 (~1e-3 relative; on two H200s the golden fp32 logits moved by 3e-4..2e-3 with it), where
the reference's torch GEMMs are true fp32. So every dot of the fp32 forward pass must say HIGHEST in the
lowered program, whatever the process-wide default (tests/conftest.py sets "highest"; a user may not).
On CPU both precisions compute the same, which is why this checks the program, not the numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.model import run_model


def _dots(fn, *args) -> list[str]:
    with jax.default_matmul_precision("bfloat16"):  # the cheapest default: only explicit precisions survive
        text = jax.jit(fn).lower(*args).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def test_every_dot_of_the_fp32_model_is_full_precision(golden_model_fp32):
    dots = _dots(lambda m, t: m(t), golden_model_fp32, jnp.zeros((1, 8), jnp.int32))
    assert len(dots) > 100  # projections, attention, experts, ... of 13 layers
    assert [d for d in dots if "HIGHEST" not in d] == []


def test_every_dot_of_an_fp32_decode_step_is_full_precision(golden_model_fp32):
    cache = golden_model_fp32.empty_cache(1, 8)
    step = lambda m, c, t: run_model(m, t[:, None], c)  # noqa: E731 (decode_step's jitted body)
    dots = _dots(step, golden_model_fp32, cache, jnp.zeros((1,), jnp.int32))
    assert len(dots) > 50
    assert [d for d in dots if "HIGHEST" not in d] == []


def test_the_bf16_model_keeps_native_dots(golden_model_bf16):
    dots = _dots(lambda m, t: m(t), golden_model_bf16, jnp.zeros((1, 8), jnp.int32))
    bf16_dots = [d for d in dots if "xbf16>" in d.split(":")[-1].split("->")[0]]
    assert bf16_dots and all("HIGHEST" not in d for d in bf16_dots)
