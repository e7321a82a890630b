"""`k3jax demo`: the whole user path on an embedded tiny K3, in well under two minutes on a laptop.

1. write a tiny K3 (the golden checkpoint's config, seeded random weights) in the exact HF release
   format, MXFP4 experts included;
2. convert it to per-layer Orbax checkpoints (`k3jax convert`);
3. restore it sharded over a device mesh (8 CPU devices unless accelerators are present);
4. generate from a text prompt (byte-level tokenizer: the tiny model has no tiktoken file), streaming
   tokens, and report tokens/s.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

DEMO_MESH = "data=2,expert=2,tensor=2"
GOLDEN_TINY = Path(__file__).resolve().parents[1] / "tests" / "golden" / "k3-tiny-a"  # shipped with the repo


def run_demo(*, prompt: str = "Kimi K3 in JAX: ", max_new_tokens: int = 24, mesh: str | None = None,
             workdir: Path | None = None) -> int:
    """Run the four steps; `mesh` defaults to DEMO_MESH on 8 devices, else experts over all devices."""
    import jax
    import numpy as np

    import k3jax
    from k3jax.checkpoint.release_writer import write_release
    from k3jax.convert import convert
    from k3jax.tokenizer import load_tokenizer

    mesh = mesh or (DEMO_MESH if jax.device_count() == 8 else "expert=-1")

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        start = time.perf_counter()
        release = write_release(Path(tmp) / "release", json.loads((GOLDEN_TINY / "config.json").read_text()), seed=0, std=0.5)
        print(f"1. wrote a tiny K3 in the release format: {release} ({time.perf_counter() - start:.1f} s)")

        start = time.perf_counter()
        converted = convert(release, Path(tmp) / "orbax", dtype="bfloat16", progress=False).out_dir
        print(f"2. converted to Orbax: {converted} ({time.perf_counter() - start:.1f} s)")

        start = time.perf_counter()
        model = k3jax.from_pretrained(converted, dtype="bfloat16", mesh=mesh)
        devices = jax.devices()
        print(f"3. restored over mesh {mesh} on {len(devices)} {devices[0].platform} devices "
              f"({time.perf_counter() - start:.1f} s)")

        tokenizer = load_tokenizer(release)
        ids = np.asarray([tokenizer.encode(prompt)], np.int32)
        print(f"4. prompt {prompt!r} -> {ids.shape[1]} tokens; generating {max_new_tokens}:")
        k3jax.generate(model, ids, max_new_tokens=max_new_tokens, on_token=lambda tokens: None)  # compile first
        streamed: list[int] = []
        start = time.perf_counter()
        new = k3jax.generate(model, ids, max_new_tokens=max_new_tokens,
                             on_token=lambda tokens: streamed.append(int(tokens[0])))
        elapsed = time.perf_counter() - start
        new_ids = np.asarray(new)[0].tolist()
        assert new_ids == streamed, "the streamed tokens must be the returned ones"
        print(f"   ids:  {new_ids}")
        print(f"   text: {tokenizer.decode(new_ids)!r} (random weights: the text is noise)")
        print(f"   {max_new_tokens / elapsed:.1f} tokens/s (batch 1, streamed, compiled)")
    return 0
