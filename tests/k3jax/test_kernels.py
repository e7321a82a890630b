"""The model's kernel choice (`k3jax.kernels.Kernels`): how it is given, and that it reaches every op
at every call site (prefill, decode_step, generate), recorded where the model calls each op."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import k3jax
from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.layer_plan import LayerPlan, plan_layers
from k3jax.model import K3Model
from k3jax.nn import kda as kda_module
from k3jax.nn import mla as mla_module
from k3jax.nn import moe as moe_module
from k3jax.nn.decoder import DecoderLayer
from tests.conftest import GOLDEN_DIR

# The op entries the layers call, by the name they have in the layer's module.
OPS = {"chunk_kda_fused": kda_module, "kda_decode": kda_module, "routed_experts": moe_module,
       "mla_prefill_attention": mla_module}


@pytest.fixture(scope="module")
def cfg() -> K3Config:
    """The golden config cut to 6 layers that keep every kind of place an op is called from: an unrolled
    head (KDA, dense FFN), two scanned groups of [KDA+MoE, MLA+MoE] and an unrolled tail (MLA+MoE); fewer
    layers than the golden 13, so each call site compiles sooner."""
    data = json.loads((GOLDEN_DIR / "config.json").read_text())
    text = data["text_config"]
    text["num_hidden_layers"] = 6
    text["linear_attn_config"]["kda_layers"] = [1, 2, 4]
    text["linear_attn_config"]["full_attn_layers"] = [3, 5, 6]
    cfg = K3Config.from_hf(data, dtype="float32")
    assert plan_layers(cfg.layer_kinds) == LayerPlan(num_layers=6, start=1, period=2, num_groups=2)
    return cfg


def test_kernels_of_accepts_a_kernels_a_mapping_or_none():
    assert Kernels.of(None) == Kernels()
    assert Kernels.of({"moe": "xla"}) == Kernels(moe="xla")
    chosen = Kernels(kda="xla")
    assert Kernels.of(chosen) is chosen
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['attention'\]"):
        Kernels.of({"attention": "xla"})
    with pytest.raises(TypeError, match=r"kernels\['moe'\]: expected an implementation name or None"):
        Kernels.of({"moe": 1})
    with pytest.raises(TypeError, match="expected a Kernels, a mapping or None"):
        Kernels.of("xla")


def test_model_keeps_its_choice_as_static_structure(cfg):
    default, chosen = K3Model.init(cfg), K3Model.init(cfg, kernels={"kda": "xla", "moe": "xla"})
    assert default.kernels == Kernels() and chosen.kernels == Kernels(kda="xla", moe="xla")
    # Static: part of the tree structure (a jitted call compiles per choice), not a leaf.
    assert jax.tree_util.tree_structure(default) != jax.tree_util.tree_structure(chosen)
    assert len(jax.tree.leaves(default)) == len(jax.tree.leaves(chosen))


def test_layers_of_one_model_share_one_choice(cfg):
    rngs = nnx.Rngs(0)
    layers = [
        DecoderLayer(cfg, mixer, ffn, dtype=jnp.float32, rngs=rngs, kernels=Kernels(moe="xla" if i == 5 else None))
        for i, (mixer, ffn) in enumerate(cfg.layer_kinds)
    ]
    with pytest.raises(ValueError, match="decoder layers were built with different kernels"):
        K3Model(cfg, layers, rngs=rngs)


def record_ops(monkeypatch) -> set[tuple[str, object]]:
    """Wrap each op entry so every trace records (op, the implementation it was asked for)."""
    seen: set[tuple[str, object]] = set()
    for name, module in OPS.items():
        original = getattr(module, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            seen.add((_name, kwargs.get("implementation", "<not passed>")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return seen


def run_and_record(monkeypatch, model: K3Model) -> dict[str, set[tuple[str, object]]]:
    """The ops each call site traces: prefill, one decode step, generate (one program), generate
    streaming (the per-step programs)."""
    seen = record_ops(monkeypatch)
    prompt = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32)
    by_site = {}

    def site(name: str, run):
        jax.clear_caches()
        seen.clear()
        result = run()
        by_site[name] = set(seen)
        return result

    _, cache = site("prefill", lambda: k3jax.prefill(model, prompt, capacity=8))  # decode_step's input (donated)
    site("decode_step", lambda: k3jax.decode_step(model, cache, prompt[:, 0]))
    site("generate", lambda: k3jax.generate(model, prompt, max_new_tokens=3))
    site("generate_streaming", lambda: k3jax.generate(model, prompt, max_new_tokens=3, on_token=lambda t: None))
    return by_site


def test_kda_mla_and_moe_choice_reach_every_call_site(cfg, monkeypatch):
    by_site = run_and_record(monkeypatch, K3Model.init(cfg, kernels={"kda": "xla", "moe": "xla", "mla": "xla"}))
    chunked = {("chunk_kda_fused", "xla"), ("routed_experts", "xla"), ("mla_prefill_attention", "xla")}
    for name in ("prefill", "generate", "generate_streaming"):
        assert chunked <= by_site[name], f"{name} traced {sorted(map(str, by_site[name]))}"
    for name, seen in by_site.items():
        asked = {impl for op, impl in seen if op != "kda_decode"}
        assert asked == {"xla"}, f"{name}: chunk_kda_fused / routed_experts / mla were asked for {asked}, not only 'xla'"
    assert ("routed_experts", "xla") in by_site["decode_step"]
    # One token: the recurrent KDA step and the absorbed MLA form.
    assert not any(op in ("chunk_kda_fused", "mla_prefill_attention") for op, _ in by_site["decode_step"])


def test_kda_decode_choice_reaches_every_decode_step(cfg, monkeypatch):
    by_site = run_and_record(monkeypatch, K3Model.init(cfg, kernels={"kda_decode": "xla"}))
    for name in ("decode_step", "generate", "generate_streaming"):
        decode = {impl for op, impl in by_site[name] if op == "kda_decode"}
        assert decode == {"xla"}, f"{name}: kda_decode was asked for {decode}, not 'xla'"
