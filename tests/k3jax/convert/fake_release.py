"""A header-faithful fake of the real Kimi K3 release, with sparse bodies: the full-scale rehearsal.

`write_fake_release(root)` writes what `moonshotai/Kimi-K3` ships as far as a converter can tell
without reading data: `config.json` (configs/kimi_k3.json), `model.safetensors.index.json`, and 96
shards `model-000NN-of-000096.safetensors` whose headers list every tensor of the release with its
real name, shape and dtype — bf16 weights, the fp32 KDA / router tensors, `A_log` zero-padded to
head_dim, routed experts as MXFP4 `weight_packed` [out, in/2] + `weight_scale` [out, in/32] uint8
pairs (896 experts x 3 projections x 92 MoE layers), and the MoonViT vision tower and projector
(shapes from `vision_config`, names as in the golden release). Each shard's data section is made by
`os.truncate`, so the ~1.45 TB of bodies are holes: nothing is written and no disk is used (reading
them would give zeros). Tensors are laid out in release order (embeddings, layers 0..92, head,
vision) and cut into 96 shards of about equal size, so experts of a layer can straddle two shards.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
from flax import nnx

from k3jax.checkpoint.names import EXPERTS_PREFIX, VISION, abstract_items, release_name
from k3jax.config import K3Config
from k3jax.model import K3Model

REPO = Path(__file__).resolve().parents[3]
RELEASE_CONFIG = REPO / "configs" / "kimi_k3.json"
NUM_SHARDS = 96
_ST_DTYPES = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8"}


def release_tensors(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor of the release described by `config`, in order."""
    cfg = K3Config.from_hf(config)
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg))
    tensors = []
    for item, slots in abstract_items(abstract).items():
        if item == VISION:  # listed from vision_config alone, so the model's names are checked against it
            continue
        for slot, leaf in slots.items():
            name, dtype, shape = release_name(slot), _ST_DTYPES[np.dtype(leaf.dtype).name], tuple(leaf.shape)
            if slot.target.startswith(EXPERTS_PREFIX):
                num_experts, out, cols = shape
                base = name.removesuffix(slot.target) + EXPERTS_PREFIX
                projection = slot.target.removeprefix(EXPERTS_PREFIX)
                for e in range(num_experts):
                    tensors.append((f"{base}{e}.{projection}.weight_packed", "U8", (out, cols // 2)))
                    tensors.append((f"{base}{e}.{projection}.weight_scale", "U8", (out, cols // 32)))
            elif slot.target == "self_attn.A_log":
                tensors.append((name, "F32", (cfg.kda_head_dim,)))  # release quirk: padded to head_dim
            else:
                tensors.append((name, dtype, shape))
    return tensors + _vision_tensors(config["vision_config"])


def _vision_tensors(v: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """MoonViT + patch-merger projector, named as in the release (see the golden checkpoint)."""
    d, qkv, inter = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"]
    merged = v["mm_hidden_size"] * math.prod(v["merge_kernel_size"])
    out = [
        ("vision_tower.patch_embed.proj.weight", "BF16", (d, 3, v["patch_size"], v["patch_size"])),
        ("vision_tower.patch_embed.pos_emb.weight", "BF16", (v["init_pos_emb_height"], v["init_pos_emb_width"], d)),
    ]
    for i in range(v["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}."
        out += [(block + "norm0.weight", "BF16", (d,)), (block + "norm1.weight", "BF16", (d,)),
                (block + "wqkv.weight", "BF16", (3 * qkv, d)), (block + "wo.weight", "BF16", (d, qkv)),
                (block + "mlp.fc0.weight", "BF16", (inter, d)), (block + "mlp.fc1.weight", "BF16", (d, inter))]
    out += [("vision_tower.encoder.final_layernorm.weight", "BF16", (d,)),
            ("mm_projector.proj.0.weight", "BF16", (merged, merged)),
            ("mm_projector.proj.2.weight", "BF16", (v["text_hidden_size"], merged)),
            ("mm_projector.post_norm.weight", "BF16", (v["text_hidden_size"],))]
    return out


_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1}


def write_fake_release(root: Path, config_path: Path = RELEASE_CONFIG, num_shards: int = NUM_SHARDS) -> Path:
    """Write the fake release into `root` (created); returns `root`. Takes seconds and ~100 MB of headers."""
    config = json.loads(config_path.read_text())
    tensors = release_tensors(config)
    sizes = [math.prod(shape) * _ITEMSIZE[dtype] for _, dtype, shape in tensors]
    target = sum(sizes) / num_shards
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    weight_map, start, filled = {}, 0, 0
    for shard in range(num_shards):
        stop = start
        while stop < len(tensors) and (shard == num_shards - 1 or filled + sizes[stop] / 2 <= target * (shard + 1)):
            filled += sizes[stop]
            stop += 1
        file = f"model-{shard + 1:05d}-of-{num_shards:06d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for (name, dtype, shape), nbytes in zip(tensors[start:stop], sizes[start:stop]):
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            weight_map[name] = file
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-aligned, as safetensors writes it
        with (root / file).open("wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
        os.truncate(root / file, 8 + len(blob) + offset)  # the body: a hole, no blocks allocated
        start = stop
    if start != len(tensors):
        raise AssertionError("tensors left over after the last shard")
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root
