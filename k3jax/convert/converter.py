"""`convert`: a Hugging Face K3 release directory -> per-layer Orbax items (layout in `checkpoint.store`).

The plan is built and checked from headers first (`planned`), so a broken release fails before
anything is written. On one host, items are then made and written one at a time, the next one read
while the current one is written — peak host memory is about two items (the largest decoder layer or
embedding table) — and each is committed to the manifest only once it is fully on disk, which is
what makes `resume` safe after a kill. With a mesh, `sharded` does the same with shard-local reads.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from k3jax.checkpoint.release_plan import ReleasePlan
from k3jax.checkpoint.store import ItemStore, leaf_record, mark_complete, write_manifest
from k3jax.checkpoint.transform import item_buffer_bytes, materialize_item
from k3jax.convert.output import ConvertResult, open_output, verify_output
from k3jax.convert.planned import plan_conversion
from k3jax.convert.sharded import convert_sharded


def convert(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16", experts: str | None = None,
    resume: bool = False, verify: bool = False, progress: bool = True, mesh: str | Mesh | None = None,
    sync: bool = True,
) -> ConvertResult:
    """Convert `hf_dir` into `out_dir`; with `resume`, continue an interrupted conversion there.

    `sync=False` (single-process conversions) commits items without waiting for their data to reach
    the disk, as `cp` does: a killed conversion still resumes exactly, but one cut short by a crash
    or power loss of the machine may have committed items whose data never reached the disk
    (`--verify` finds them). It saves the time of writing everything to the disk, when that is
    slower than converting.

    With `mesh` ("expert=8" or a Mesh, over every process's devices) each process reads and writes
    only its devices' slices (`sharded`); the output is the same."""
    hf_dir, out_dir = Path(hf_dir).absolute(), Path(out_dir).absolute()  # Orbax needs absolute paths
    if mesh is not None:
        return convert_sharded(hf_dir, out_dir, mesh=mesh, dtype=dtype, experts=experts, resume=resume,
                               verify=verify, progress=progress)
    start = time.perf_counter()
    planned = plan_conversion(hf_dir, dtype=dtype, experts=experts)
    root = out_dir
    store = ItemStore(root)
    manifest = open_output(root, planned, resume, store)
    store.remove_all_but(set(manifest["items"]))
    todo = [item for item in planned.plan.items if item.name not in manifest["items"]]
    done_bytes = planned.plan.nbytes - sum(item.nbytes for item in todo)

    def prepare(i):
        return materialize_item(todo[i], planned.index, buffers[i % len(buffers)])

    def commit(item, records):
        store.commit(item.name, sync=sync)
        manifest["items"][item.name] = records.result()
        manifest["files"][item.name] = store.files(item.name)
        write_manifest(root, manifest)
        bar.update(item.nbytes)

    # Four stages overlap (reads, crc32, TensorStore writes and fsync all release the GIL): item i+1 is
    # read while item i is checksummed (on all cores) and written to the page cache, and item i-1 is
    # fsynced and committed. Commits run in order on one thread, so what a kill leaves behind is
    # unchanged; a bad tensor in item i+1 fails once item i is committed. Memory: two items in flight
    # (one when the largest item is over a quarter of RAM); an item being fsynced holds no arrays.
    with tqdm(total=planned.plan.nbytes, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              desc="convert", disable=not progress, dynamic_ncols=True) as bar, \
            ThreadPoolExecutor(1, thread_name_prefix="k3jax-convert-read") as reader, \
            ThreadPoolExecutor(1, thread_name_prefix="k3jax-convert-checksum") as hasher, \
            ThreadPoolExecutor(1, thread_name_prefix="k3jax-convert-commit") as committer:
        read_ahead = _may_read_ahead(planned.plan)
        # Items are read into the same two buffers (one without read-ahead) in turn: item i+2 reuses
        # item i's once that is written and checksummed, so memory is touched once, not per item.
        size = max((item_buffer_bytes(item) for item in todo), default=0)
        buffers = [np.empty(size, np.uint8) for _ in range(2 if read_ahead else 1)]
        upcoming = reader.submit(prepare, 0) if todo else None
        hashed = committed = None
        for i, item in enumerate(todo):
            bar.set_postfix_str(item.name)
            leaves = upcoming.result()
            if hashed is not None:
                hashed.result()  # the previous item's arrays are free once it is checksummed
            upcoming = reader.submit(prepare, i + 1) if read_ahead and i + 1 < len(todo) else None
            hashed = hasher.submit(_leaf_records, leaves)
            store.write(item.name, leaves)
            del leaves
            if committed is not None:
                committed.result()  # one commit in flight; a failed one stops the conversion here
            committed = committer.submit(commit, item, hashed)
            if not read_ahead and i + 1 < len(todo):
                hashed.result()
                upcoming = reader.submit(prepare, i + 1)
        if committed is not None:
            committed.result()
    if verify:
        verify_output(root, store, planned, manifest)
    mark_complete(root)
    return ConvertResult(root, len(todo), len(planned.plan.items) - len(todo), planned.plan.nbytes,
                         time.perf_counter() - start)


def _leaf_records(leaves: dict) -> dict:
    return {name: leaf_record(array) for name, array in leaves.items()}


def _may_read_ahead(plan: ReleasePlan) -> bool:
    """Read the next item while writing one only if two of the largest items fit comfortably in RAM
    (a full-size layer is 15.8 GiB with MXFP4 experts, ~59 GiB with bf16 ones)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return False
    return 4 * max(item.nbytes for item in plan.items) <= physical
