"""`convert(..., mesh=...)`: every process reads and writes only its own devices' slices.

Each item's leaves are built as global jax.Arrays with `jax.make_array_from_callback`, in the
NamedShardings that `from_pretrained(OUT, mesh=...)` restores into (`load.placement.slot_shardings`,
i.e. `sharding.param_shardings` by DEFAULT_RULES). The callback of a device reads only its slice's
source bytes (`checkpoint.region.leaf_array`: an expert-sharded leaf opens only its experts' tensors,
a row-split leaf reads only its rows), and one process reads each read box once, however many of its
devices share it. Orbax then writes each process's addressable shards. So in one process the bytes read are the
source bytes exactly, whatever the mesh; with several processes a leaf that is replicated (or split
only along inner dimensions) across processes is read by each process that holds it.

The output is the single-host conversion's: the same items, leaves, manifest and checksums (only
Orbax's chunking of the files follows the shards), so either kind of run can resume the other's
directory and loads do not care which wrote it. The manifest records each leaf's checksum over the
whole leaf (`store.leaf_record`), so each leaf is brought to host once to be checksummed: in one
process that is a copy of its shards; with several processes it is an all-gather (every process
receives the leaf, one leaf at a time) and process 0 alone hashes. This is the cost of keeping the
checksum definition; a per-block checksum would let processes hash their own part.

Several processes (see docs/multihost.md): every process runs the same call after
`k3jax.distributed.initialize()`, with HF_DIR and OUT on a filesystem they all see under the same path.
Process 0 alone writes the manifest, renames finished items and marks the directory COMPLETE; the
others wait at barriers and fail with it. `verify` needs one process (it restores every item to host,
and Orbax restores are collective): verify afterwards with `convert(..., resume=True, verify=True)`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

from k3jax.checkpoint.region import leaf_array
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.checkpoint.store import (
    ItemStore,
    leaf_record,
    mark_complete,
    nest,
    read_manifest,
    remove_path,
    write_manifest,
)
from k3jax.convert.output import ConvertResult, open_output, verify_output
from k3jax.convert.planned import plan_conversion
from k3jax.load.placement import slot_shardings
from sharding import make_mesh

T = TypeVar("T")


def host_copy(array: jax.Array) -> np.ndarray:
    """The whole array on this host: its shards when they cover it, else an all-gather across processes."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _record(array: jax.Array) -> dict | None:
    """The leaf's manifest record, on process 0 (the one that writes the manifest); every process must
    call this, since with several processes the leaf is all-gathered."""
    host = host_copy(array)
    return leaf_record(host) if jax.process_index() == 0 else None


def convert_sharded(
    hf_dir: str | Path, out_dir: str | Path, *, mesh: str | Mesh, dtype: str = "bfloat16",
    experts: str | None = None, resume: bool = False, verify: bool = False, progress: bool = True,
) -> ConvertResult:
    """`converter.convert` with shard-local reads on `mesh` (a spec such as "expert=8" or a Mesh)."""
    if verify and jax.process_count() > 1:
        raise CheckpointError(f"--verify reads the whole conversion back in one process; convert with "
                              f"{jax.process_count()} processes without it, then run `k3jax convert {hf_dir} "
                              f"{out_dir} --resume --verify` as a single process")
    start = time.perf_counter()
    mesh = make_mesh(mesh)
    planned = plan_conversion(hf_dir, dtype=dtype, experts=experts)
    shardings = slot_shardings(planned.abstract, mesh)
    root = Path(out_dir).absolute()  # Orbax needs absolute paths
    store = ItemStore(root)

    def open_dir() -> None:
        manifest = open_output(root, planned, resume, store)
        store.remove_all_but(set(manifest["items"]))

    _on_process_zero(f"open the output directory {root}", open_dir)
    manifest = read_manifest(root)
    todo = [item for item in planned.plan.items if item.name not in manifest["items"]]
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))  # as ItemStore's
    with tqdm(total=planned.plan.nbytes, initial=planned.plan.nbytes - sum(item.nbytes for item in todo),
              unit="B", unit_scale=True, unit_divisor=1024, desc=f"convert on {len(mesh.devices.flat)} devices",
              disable=not progress or jax.process_index() != 0, dynamic_ncols=True) as bar:
        for item in todo:
            bar.set_postfix_str(item.name)
            leaves = {leaf.target: leaf_array(leaf, planned.index, shardings[(item.name, leaf.target)])
                      for leaf in item.leaves}
            records = {name: _record(array) for name, array in leaves.items()}
            _save(store, checkpointer, item.name, leaves)
            manifest["items"][item.name] = records

            def commit(name: str = item.name) -> None:
                manifest["files"][name] = store.files(name)
                write_manifest(root, manifest)

            _on_process_zero(f"commit {item.name} to {root}", commit)
            del leaves
            bar.update(item.nbytes)
    if verify:
        verify_output(root, store, planned, manifest)
    _on_process_zero(f"mark {root} complete", lambda: mark_complete(root))
    return ConvertResult(root, len(todo), len(planned.plan.items) - len(todo), planned.plan.nbytes,
                         time.perf_counter() - start)


def _save(store: ItemStore, checkpointer: ocp.Checkpointer, item: str, leaves: dict[str, jax.Array]) -> None:
    """All processes write their shards under a temporary name; process 0 renames it when all are done."""
    tmp = store.items / f"{item}.tmp"

    def clear() -> None:
        store.items.mkdir(parents=True, exist_ok=True)
        remove_path(tmp)

    _on_process_zero(f"prepare {tmp}", clear)
    checkpointer.save(tmp, nest(leaves))
    _on_process_zero(f"rename {tmp}", lambda: os.rename(tmp, store.path(item)))


def _on_process_zero(what: str, fn: Callable[[], T]) -> T | None:
    """Run `fn` on process 0 only; the others wait for it and fail too if it failed."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except Exception as err:  # reported to every process below, then re-raised here
            error = err
    ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"process 0 failed to {what}; its log has the error")
    return result
