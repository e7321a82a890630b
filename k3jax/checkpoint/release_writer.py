"""Write a randomly initialised K3 in the exact Hugging Face release layout.

`language_model.*` names, one MXFP4 (`weight_packed`, `weight_scale`) pair per routed expert,
`A_log` zero-padded to head_dim, several shards plus `model.safetensors.index.json`. Used by the
demo (a release to convert and load without downloading 1.45 TB) and by tests that need configs
wider than the golden checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from k3jax.checkpoint.names import EXPERTS_PREFIX, MXFP4_SUFFIXES, abstract_items, release_name
from k3jax.config import K3Config
from k3jax.model import K3Model
from pallas_kernels.mxfp4 import encode_mxfp4


def write_release(root: Path, config: dict, *, seed: int = 0, num_shards: int = 2, std: float = 0.02) -> Path:
    """Random weights (normal, `std`) for `config` (a release config.json dict), written as `root`."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    cfg = K3Config.from_hf(config)
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg))  # shapes and dtypes only
    rng = np.random.default_rng(seed)
    random = lambda shape, dtype: (std * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)  # noqa: E731
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(num_shards)]
    for n, slots in enumerate(abstract_items(abstract).values()):
        tensors = shards[n % num_shards]
        for slot, leaf in slots.items():
            name = release_name(slot)
            if slot.target.startswith(EXPERTS_PREFIX):
                packed, scale = encode_mxfp4(random(leaf.shape, np.float32))
                base = name.removesuffix(slot.target) + EXPERTS_PREFIX
                projection = slot.target.removeprefix(EXPERTS_PREFIX)
                for e in range(leaf.shape[0]):
                    for suffix, array in zip(MXFP4_SUFFIXES, (packed, scale)):
                        tensors[f"{base}{e}.{projection}{suffix}"] = array[e]
            elif slot.target == "self_attn.A_log":  # log U(1, 16) per head, padded like the release
                a_log = np.log(rng.uniform(1.0, 16.0, leaf.shape)).astype(np.float32)
                tensors[name] = np.pad(a_log, (0, cfg.kda_head_dim - leaf.shape[0]))
            elif slot.target.endswith("norm.weight"):  # norm gains near 1, as trained models have
                tensors[name] = (1.0 + random(leaf.shape, np.float32)).astype(leaf.dtype)
            else:
                tensors[name] = random(leaf.shape, np.dtype(leaf.dtype))
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{num_shards:06d}.safetensors"  # the release's 5/6-digit quirk
        save_file(tensors, str(root / file))
        weight_map.update({name: file for name in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root
