"""Mesh specs without devices: the planner's device count and the abstract mesh `--plan-only` uses."""

from __future__ import annotations

import jax
import pytest

from k3jax.load.placement import spec_device_count, spec_mesh
from k3jax.memory_plan import mesh_device_count


def test_explicit_specs_name_their_device_count():
    assert spec_device_count("expert=8,tensor=4") == 32
    assert spec_device_count("expert=-1") is None
    mesh = spec_mesh("tensor=4, expert=8")
    assert mesh.size == 32 and dict(mesh.shape) == {"data": 1, "fsdp": 1, "context": 1, "expert": 8, "tensor": 4}


def test_a_free_axis_takes_the_given_or_local_devices():
    assert dict(spec_mesh("data=2,expert=-1", num_devices=16).shape)["expert"] == 8
    assert spec_mesh("fsdp=-1").size == jax.device_count()


@pytest.mark.parametrize(("spec", "message"), [("pipeline=2", "unknown axis 'pipeline'"), ("expert=0", "size 0"),
                                               ("expert=two", "not an integer"), ("expert", "axis=size")])
def test_bad_specs_are_reported_by_the_sharding_parser(spec, message):
    with pytest.raises(ValueError, match=message):
        spec_mesh(spec)


def test_the_planner_needs_explicit_sizes():
    assert mesh_device_count("expert=8,tensor=4") == 32
    with pytest.raises(ValueError, match="explicit axis sizes"):
        mesh_device_count("expert=-1")
