"""`from_pretrained`: the one call that turns a release (or converted) directory into a ready model."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.checkpoint.store import MANIFEST, is_converted
from k3jax.kernels import Kernels
from k3jax.load import load_converted, load_hf_model
from k3jax.load.paths import checkpoint_path, is_remote, remote_is_file
from k3jax.model import K3Model

_DTYPES = ("bfloat16", "float32")
LAYER_LAYOUTS = ("scanned", "unrolled", "auto")


def from_pretrained(
    path: str | os.PathLike, *, dtype: str = "bfloat16", mesh: str | Mesh | None = None,
    kernels: Kernels | Mapping[str, str | None] | None = None, experts: str | None = None,
    verify: bool = False, layers: str = "scanned",
) -> K3Model:
    """Load a Hugging Face K3 release directory (config.json, safetensors index and shards), or a
    directory written by `k3jax convert` (recognised by its manifest; it must be COMPLETE). A converted
    checkpoint may also be a URL such as "gs://bucket/kimi-k3-orbax" (given as a string; read through
    etils `epath`, as Orbax reads it); a release directory must be local.

    `dtype` is the storage and activation dtype of the bf16 tensors (fp32 tensors such as the KDA
    state parameters and the router bias stay fp32). `mesh` ("expert=4,tensor=2", a Mesh, or None for
    one device) places every parameter by `sharding.DEFAULT_RULES` as it is read (a release: each
    device reads its own slices; a converted directory: restored straight into the shardings); jitted
    calls then run partitioned.

    `kernels` chooses each op's implementation (`k3jax.kernels.Kernels`, or a mapping such as
    `{"moe": "xla"}`); None fields follow the platform's policy.

    `experts`: "mxfp4" keeps the routed experts MXFP4-packed (uint8 codes + E8M0 scales, 4.25 bits per
    weight, decoded on the fly before the expert GEMMs; same logits), "bf16" decodes them into the
    model dtype at load time; None loads a converted directory as it was converted and decodes a
    release's experts.

    `verify=True` (a converted directory) checks every leaf against the crc32 the manifest recorded
    at conversion, so a damaged file is an error naming its item instead of silently wrong weights.
    It costs a full read and checksum of every item on the host (with a mesh, on top of the sharded
    restore): about the time of converting without writing. A release directory has no checksums.

    `layers`: "scanned" keeps the repeated layer groups stacked under `lax.scan` (compile time flat in
    depth; what training uses); "unrolled" gives every layer arrays of its own
    (`K3Model.unroll_layers`: decode reads each weight in place instead of copying it first, at a
    longer compile); "auto" unrolls on GPU and TPU, where the weights feed custom-call kernels, and
    scans on CPU.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {_DTYPES}")
    unroll = unrolls(layers)
    model = _load(path, dtype=dtype, mesh=mesh, kernels=kernels, experts=experts, verify=verify)
    if unroll:
        model.unroll_layers()
    return model


def unrolls(layers: str) -> bool:
    """Whether the layout `layers` (one of LAYER_LAYOUTS) unrolls the layers on this backend."""
    if layers not in LAYER_LAYOUTS:
        raise ValueError(f"layers={layers!r}: expected one of {LAYER_LAYOUTS}")
    return layers == "unrolled" or (layers == "auto" and jax.default_backend() != "cpu")


def add_layers_argument(parser: argparse.ArgumentParser) -> None:
    """`--layers` of the inference commands (generate, chat, serve): `from_pretrained`'s `layers`."""
    parser.add_argument("--layers", choices=LAYER_LAYOUTS, default="auto",
                        help="scanned: faster compiles; unrolled: faster decode (each layer's weights read "
                             "in place); auto (default): unrolled on GPU/TPU, scanned on CPU")


def _load(path: str | os.PathLike, *, dtype: str, mesh: str | Mesh | None,
          kernels: Kernels | Mapping[str, str | None] | None, experts: str | None, verify: bool) -> K3Model:
    kernels = Kernels.of(kernels)
    root = checkpoint_path(path)  # once, for every road below: a URL as given, a local path made absolute
    if is_remote(root):
        if not remote_is_file(root / MANIFEST):
            raise CheckpointError(f"{root} has no {MANIFEST}: only `k3jax convert` outputs load from remote "
                                  "storage; convert the release into a local directory (k3jax convert HF_DIR OUT), "
                                  "then load OUT or a copy of it at a URL")
        return load_converted(root, dtype=dtype, experts=experts, kernels=kernels, mesh=mesh, verify=verify)
    if is_converted(root):
        return load_converted(root, dtype=dtype, experts=experts, kernels=kernels, mesh=mesh, verify=verify)
    if verify:
        raise ValueError(f"verify=True checks the checksums of a `k3jax convert` directory; {root} is not one "
                         "(a release has no checksums: convert it with --verify)")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; expected a Hugging Face release directory")
    return load_hf_model(root, dtype=dtype, experts=experts, kernels=kernels, mesh=mesh)
