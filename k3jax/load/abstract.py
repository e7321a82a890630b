"""The abstract K3Model: every leaf's shape and dtype, nothing allocated.

Loaders fill it (`assemble`), the release plan is checked against it (`checkpoint.release_plan`), and the
memory planner compiles programs over it. Routed experts are dense (the model dtype) or MXFP4-packed
(uint8 codes + E8M0 scales, decoded on the fly by the model). `kernels` is part of the model's
structure (which implementation each op runs), so it is chosen here, once, for every road that
builds a model.
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.model import K3Model
from k3jax.nn.moe import pack_routed_experts


def abstract_model(
    cfg: K3Config, *, packed_experts: bool = False, kernels: Kernels | Mapping[str, str | None] | None = None
) -> K3Model:
    """`nnx.eval_shape` of `K3Model.init(cfg, kernels=...)`, its routed experts packed if asked."""
    kernels = Kernels.of(kernels)

    def build() -> K3Model:
        model = K3Model.init(cfg, kernels=kernels)
        return pack_routed_experts(model) if packed_experts else model

    return nnx.eval_shape(build)
