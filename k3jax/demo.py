"""`k3jax demo`: the whole user path on an embedded tiny K3, in well under two minutes on a laptop.

1. write a tiny K3 (the golden checkpoint's text config, `configs/k3_tiny.json`, stored in bfloat16
   as the release is, with seeded random weights) in the Hugging Face release format, MXFP4 experts
   included;
2. convert it to per-layer Orbax checkpoints (`k3jax convert`);
3. restore it sharded over a device mesh (8 CPU devices unless accelerators are present);
4. generate from a text prompt (byte-level tokenizer: the tiny model has no tiktoken file), streaming
   tokens, and report tokens/s.

The config ships inside the package (`k3jax.assets`), so the demo needs nothing but an installed
k3jax.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from k3jax.assets import packaged_config
from k3jax.checkpoint.release_writer import write_release
from k3jax.convert import convert
from k3jax.generate import generate
from k3jax.pretrained import from_pretrained
from k3jax.tokenizer import load_tokenizer
from sharding import parse_mesh_spec

DEMO_MESH = "data=2,expert=2,tensor=2"


def run_demo(*, prompt: str = "Kimi K3 in JAX: ", max_new_tokens: int = 24, mesh: str | None = None,
             workdir: Path | None = None) -> int:
    """Run the four steps; `mesh` defaults to DEMO_MESH on 8 devices, else experts over all devices. A
    mesh that does not fit the devices, or a prompt without tokens, is a ValueError before any work."""
    mesh = mesh or (DEMO_MESH if jax.device_count() == 8 else "expert=-1")
    parse_mesh_spec(mesh, jax.device_count())
    if max_new_tokens < 1 or not prompt:
        raise ValueError(f"expected a non-empty prompt and max_new_tokens >= 1, got {prompt!r} and {max_new_tokens}")
    config = packaged_config("k3_tiny") | {"dtype": "bfloat16"}

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        start = time.perf_counter()
        release = write_release(Path(tmp) / "release", config, seed=0, std=0.5)
        print(f"1. wrote a tiny K3 in the release format: {release} ({time.perf_counter() - start:.1f} s)")

        start = time.perf_counter()
        converted = convert(release, Path(tmp) / "orbax", dtype="bfloat16", progress=False).out_dir
        print(f"2. converted to Orbax: {converted} ({time.perf_counter() - start:.1f} s)")

        start = time.perf_counter()
        model = from_pretrained(converted, dtype="bfloat16", mesh=mesh)
        devices = jax.devices()
        print(f"3. restored over mesh {mesh} on {len(devices)} {devices[0].platform} devices "
              f"({time.perf_counter() - start:.1f} s)")

        tokenizer = load_tokenizer(release)
        ids = np.asarray([tokenizer.encode(prompt)], np.int32)
        print(f"4. prompt {prompt!r} -> {ids.shape[1]} tokens; generating {max_new_tokens}:")
        print("   compiling prefill and decode...", flush=True)
        start = time.perf_counter()
        generate(model, ids, max_new_tokens=max_new_tokens, on_token=lambda tokens: None)  # compile first
        print(f"   compiled ({time.perf_counter() - start:.1f} s); streaming: ", end="", flush=True)
        streamed: list[int] = []
        shown = ""

        def show(tokens: np.ndarray) -> None:
            """Print each token's text as it arrives (escaped: random weights emit control bytes)."""
            nonlocal shown
            streamed.append(int(tokens[0]))
            text = tokenizer.decode(streamed)
            print(repr(text[len(shown):])[1:-1] if text.startswith(shown) else "", end="", flush=True)
            shown = text

        start = time.perf_counter()
        new = generate(model, ids, max_new_tokens=max_new_tokens, on_token=show)
        elapsed = time.perf_counter() - start
        print()
        new_ids = np.asarray(new)[0].tolist()
        if new_ids != streamed:
            raise AssertionError(f"the streamed tokens {streamed} must be the returned ones {new_ids}")
        print(f"   ids:  {new_ids}")
        print(f"   text: {tokenizer.decode(new_ids)!r} (random weights: the text is noise)")
        print(f"   {max_new_tokens / elapsed:.1f} tokens/s (batch 1, streamed, compiled)")
    return 0
