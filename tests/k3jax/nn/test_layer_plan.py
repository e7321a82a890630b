"""Layer plan (unrolled head, scanned groups, unrolled tail) and K3Model.layer(i) access.

Exact integers and exact parameter equality throughout: no tolerances.
"""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from k3jax.config import K3Config  # noqa: E402
from k3jax.layer_plan import LayerPlan, plan_layers  # noqa: E402
from k3jax.model import K3Model  # noqa: E402

from tests.conftest import GOLDEN_DIR as GOLDEN  # noqa: E402
from tests.k3jax.nn.conftest import flat_params  # noqa: E402


def k3_release_kinds() -> list[tuple[str, str]]:
    """The released K3 pattern from its 1-based lists (k3-architecture.md §0): 93 layers, MLA at
    1-based multiples of 4 and at 93, KDA elsewhere; layer 0 dense, the rest MoE."""
    full_attn_layers = set(range(4, 93, 4)) | {93}
    kda_layers = {i for i in range(1, 94) if i not in full_attn_layers}
    assert len(full_attn_layers) == 24 and len(kda_layers) == 69
    return [("kda" if i + 1 in kda_layers else "mla", "dense" if i == 0 else "moe") for i in range(93)]


def layer_of(plan: LayerPlan, slot: tuple[str, int, int]) -> int:
    """Invert a slot independently of LayerPlan.slot."""
    where, i, j = slot
    if where == "head":
        assert j == 0
        return i
    if where == "group":
        return plan.start + i * plan.period + j
    assert where == "tail" and j == 0
    return plan.start + plan.num_groups * plan.period + i


def check_plan_covers(plan: LayerPlan, kinds) -> None:
    n = len(kinds)
    assert plan.num_layers == n
    # head, groups and tail partition [0, n) in order
    covered = list(plan.head) + list(range(plan.start, plan.start + plan.period * plan.num_groups)) + list(plan.tail)
    assert covered == list(range(n))
    # every group repeats the first group's kinds exactly (so stacking their parameters is valid)
    for g in range(plan.num_groups):
        for j in range(plan.period):
            assert kinds[plan.start + g * plan.period + j] == kinds[plan.start + j]
    for layer in range(n):
        slot = plan.slot(layer)
        assert layer_of(plan, slot) == layer
    for bad in (-1, n):
        with pytest.raises(IndexError):
            plan.slot(bad)


def test_k3_release_plan() -> None:
    kinds = k3_release_kinds()
    assert kinds[0] == ("kda", "dense") and kinds[3] == ("mla", "moe") and kinds[92] == ("mla", "moe")
    assert kinds[91] == ("mla", "moe") and kinds[90] == ("kda", "moe")
    plan = plan_layers(kinds)
    assert (plan.start, plan.period, plan.num_groups) == (4, 4, 22)
    assert list(plan.head) == [0, 1, 2, 3]
    assert list(plan.tail) == [92]
    check_plan_covers(plan, kinds)
    assert plan.slot(4) == ("group", 0, 0) and plan.slot(91) == ("group", 21, 3) and plan.slot(92) == ("tail", 0, 0)


def test_golden_tiny_plan() -> None:
    cfg = K3Config.from_hf(GOLDEN, dtype="float32")
    expected = [("kda" if i + 1 in {1, 2, 3, 5, 6, 7, 9, 10, 11} else "mla", "dense" if i == 0 else "moe") for i in range(13)]
    assert list(cfg.layer_kinds) == expected
    plan = plan_layers(cfg.layer_kinds)
    assert (plan.start, plan.period, plan.num_groups) == (4, 4, 2)
    assert list(plan.head) == [0, 1, 2, 3] and list(plan.tail) == [12]
    check_plan_covers(plan, cfg.layer_kinds)


@pytest.mark.parametrize("kinds", [list(range(10)), ["a"], ["a", "b"], ["a", "b", "a", "c", "a"]],
                         ids=["distinct10", "single", "two", "no_full_repeat"])
def test_no_repetition_gives_no_groups(kinds) -> None:
    plan = plan_layers(kinds)
    assert plan.num_groups == 0
    assert list(plan.head) == list(range(len(kinds))) and list(plan.tail) == []
    check_plan_covers(plan, kinds)


@pytest.mark.parametrize("kinds,expected", [
    (["x"] * 6, (0, 1, 6)),  # a uniform stack: one scanned group per layer
    (["d"] + ["a", "b"] * 5, (1, 2, 5)),
    (["a", "b", "c"] * 3 + ["z"], (0, 3, 3)),
])
def test_small_patterns(kinds, expected) -> None:
    plan = plan_layers(kinds)
    assert (plan.start, plan.period, plan.num_groups) == expected
    check_plan_covers(plan, kinds)


# ---- K3Model.layer(i) ------------------------------------------------------------------------------

def test_model_layer_returns_the_stacked_slice(tiny_built) -> None:
    """`tiny_built` (conftest): the model, per-layer parameter snapshots taken before stacking, cfg."""
    model, snapshots, cfg = tiny_built
    plan = model.plan
    assert (plan.start, plan.period, plan.num_groups) == (4, 4, 2)
    for i in range(cfg.num_hidden_layers):
        layer = model.layer(i)
        assert (layer.mixer_kind, layer.ffn_kind) == cfg.layer_kinds[i]
        got = flat_params(layer)
        # 1) equals the layer that was put in at index i (checks the stacking order)
        assert got.keys() == snapshots[i].keys()
        for path, value in got.items():
            np.testing.assert_array_equal(value, snapshots[i][path], err_msg=f"layer {i} {path}")
        # 2) for scanned layers, equals slice g of the stacked parameters at group position j
        where, g, j = plan.slot(i)
        if where == "group":
            stacked = flat_params(model.group_layers[j])
            assert stacked.keys() == got.keys()
            for path, value in stacked.items():
                assert value.shape == (plan.num_groups, *got[path].shape)
                np.testing.assert_array_equal(value[g], got[path], err_msg=f"layer {i} {path}")
    # Different layers really hold different parameters (the comparison above is not vacuous).
    a, b = flat_params(model.layer(4)), flat_params(model.layer(8))
    assert any(not np.array_equal(a[p], b[p]) for p in a)


def test_model_init_matches_explicit_assembly(tiny_built) -> None:
    """K3Model.init draws the layers first from one Rngs stream, as the explicit assembly above does."""
    _, snapshots, cfg = tiny_built
    model = K3Model.init(cfg, seed=0)
    for i in (0, 5, 12):
        got = flat_params(model.layer(i))
        for path, value in got.items():
            np.testing.assert_array_equal(value, snapshots[i][path], err_msg=f"layer {i} {path}")
