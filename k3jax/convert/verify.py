"""`--verify`: re-read what was written and compare it with the source, leaf by leaf.

Each leaf's checksum (crc32, see `checksum`) is computed three ways — from the source transform,
from the restored Orbax item, and as recorded in the manifest at write time — and all three must
agree. When the model is small enough to hold twice, the converted model's logits on a few tokens
must also equal, bit for bit, those of the model built straight from the release with its experts
decoded (so a packed conversion is checked against the dense model, not against itself).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from k3jax.checkpoint.release_plan import ReleasePlan
from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex
from k3jax.checkpoint.store import CHECKSUM, ItemStore, leaf_record
from k3jax.checkpoint.transform import materialize
from k3jax.config import K3Config
from k3jax.load.converted import load_items
from k3jax.load.release import release_model

LOGITS_CHECK_MAX_BYTES = 1 << 30
_NUM_TOKENS = 8


def find_bad_items(store: ItemStore, plan: ReleasePlan, index: CheckpointIndex, manifest: dict) -> dict[str, str]:
    """Item name -> what is wrong with it, for every item whose leaves do not all match the source."""
    bad: dict[str, str] = {}
    for item in plan.items:
        recorded = manifest["items"].get(item.name, {})
        try:
            on_disk = store.restore(item.name)
        except Exception as err:  # any failure to read the item back is corruption to report
            bad[item.name] = f"cannot be restored ({type(err).__name__}: {err})"
            continue
        if set(on_disk) != {leaf.target for leaf in item.leaves}:
            bad[item.name] = f"holds leaves {sorted(on_disk)}, the plan has {[leaf.target for leaf in item.leaves]}"
            continue
        for leaf in item.leaves:
            source = leaf_record(materialize(leaf, index))
            written = leaf_record(on_disk[leaf.target])
            if not source == written == recorded.get(leaf.target):
                bad[item.name] = (f"leaf {leaf.target}: source {_short(source)}, on disk {_short(written)}, "
                                  f"manifest {_short(recorded.get(leaf.target))}")
                break
    return bad


def _short(record: dict | None) -> str:
    if record is None:
        return "absent"
    return f"{record['dtype']}{record['shape']} {CHECKSUM} {record.get(CHECKSUM)}"


def check_logits(out_dir: Path, manifest: dict, cfg: K3Config, index: CheckpointIndex) -> None:
    """Logits of the converted model == logits of the model built directly from the source (dense experts)."""
    direct = release_model(index, cfg)
    converted = load_items(out_dir, manifest, dtype=cfg.dtype)
    vocab = cfg.vocab_size
    ids = jnp.asarray([[(7919 * i + 1) % vocab for i in range(_NUM_TOKENS)]], jnp.int32)
    want, got = np.asarray(direct(ids)), np.asarray(converted(ids))
    if not np.array_equal(want, got):
        raise CheckpointError(
            f"{out_dir}: logits of the converted model differ from the source's "
            f"(max abs difference {np.max(np.abs(want - got)):.3g} on {_NUM_TOKENS} tokens)"
        )
