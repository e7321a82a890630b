"""Run checkpoints: state + data position round trip, keep-N latest plus the best by loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.training.checkpointing import RunCheckpoints


def _state(step: int) -> dict:
    return {"w": jnp.arange(3, dtype=jnp.float32) * step, "step": jnp.int32(step), "rng": jax.random.key(step)}


def test_round_trip_and_retention(tmp_path):
    checkpoints = RunCheckpoints(tmp_path / "ck", keep=2, keep_best=1)
    for step, loss in {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0}.items():
        checkpoints.save(step, _state(step), position={"next_index": 10 * step}, metrics={"loss": loss})
    checkpoints.wait()
    assert checkpoints.steps() == [2, 4, 5]  # the two latest and the lowest loss
    assert checkpoints.latest_step() == 5
    state, position = checkpoints.restore(2, _state(0))
    assert position == {"next_index": 20}
    np.testing.assert_array_equal(state["w"], [0, 2, 4])
    assert int(state["step"]) == 2
    np.testing.assert_array_equal(jax.random.key_data(state["rng"]), jax.random.key_data(jax.random.key(2)))
    checkpoints.close()
    reopened = RunCheckpoints(tmp_path / "ck", keep=2, keep_best=1)
    assert reopened.steps() == [2, 4, 5]
    reopened.close()


def test_metrics_must_name_the_ranked_metric(tmp_path):
    checkpoints = RunCheckpoints(tmp_path / "ck", best_metric="eval_loss")
    with pytest.raises(ValueError, match="lack 'eval_loss'"):
        checkpoints.save(1, _state(1), position={}, metrics={"loss": 1.0})
    checkpoints.close()
