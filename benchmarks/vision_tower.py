"""MoonViT-V2 tower: k3jax (JAX, cuDNN attention through jax.nn.dot_product_attention) beside the same
tower written in PyTorch with SDPA, on the SAME random weights, full size (27 blocks, width 1024,
12 heads of 128) in bfloat16, for a 1024 x 1024 image and a 4000 x 3000 photo.

    python benchmarks/vision_tower.py --out vision_tower.json          # GPU: both sides, timed
    python benchmarks/vision_tower.py --smoke --out smoke.json         # CPU: tiny config, no torch needed

Outputs are checked to agree (bf16 tolerance) before anything is timed. The torch side also reports
which eps torch's `nn.RMSNorm` uses without one in bf16 (the tower's norms depend on it). Needs jax
(and torch + triton for the peer, present on the GPU machine); no other package.
Prints a markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import median_ms  # noqa: E402
from k3jax.config import K3Config  # noqa: E402
from k3jax.vision.tower import VisionTower  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Patch grids the release processor gives (k3jax.vision.processor.resize_plan; the smoke test checks them):
IMAGES = {"1024x1024": (1, 74, 74), "4000x3000 photo": (1, 216, 286)}
SMOKE_IMAGES = {"56x84": (1, 4, 6), "112x140": (1, 8, 10)}
BF16_TOLERANCE = 3e-2  # rel-RMS of two bf16 implementations after 27 blocks (roundings differ per op)
FP32_TOLERANCE = 1e-4


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def weights_of(tower: VisionTower) -> dict:
    """The tower's parameters as float32 numpy arrays (bf16 -> fp32 is exact, so torch gets the same)."""
    f32 = lambda p: np.asarray(p[...], np.float32)  # noqa: E731
    return {
        "proj": f32(tower.patch_embed.proj.weight), "pos": f32(tower.patch_embed.pos_emb.weight),
        "final": f32(tower.encoder.final_layernorm.weight),
        "blocks": [{"norm0": f32(b.norm0.weight), "wqkv": f32(b.wqkv.weight), "wo": f32(b.wo.weight),
                    "norm1": f32(b.norm1.weight), "fc0": f32(b.mlp.fc0.weight), "fc1": f32(b.mlp.fc1.weight)}
                   for b in tower.encoder.blocks],
    }


def torch_tower(weights: dict, cfg, dtype: str, device: str):
    """The official forward for one image, compactly, in torch: returns f(pixels [L, 3, p, p]) -> merged."""
    import torch
    import torch.nn.functional as F

    tdtype = getattr(torch, dtype)
    w = {k: torch.tensor(v, device=device).to(tdtype) for k, v in weights.items() if k != "blocks"}
    blocks = [{k: torch.tensor(v, device=device).to(tdtype) for k, v in b.items()} for b in weights["blocks"]]
    d, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim

    def run(pixels, grid):
        _, h, wd = grid
        n = h * wd
        x = pixels.to(tdtype).reshape(n, -1) @ w["proj"].reshape(d, -1).T
        pos = F.interpolate(w["pos"].permute(2, 0, 1)[None], size=(h, wd), mode="bilinear", align_corners=False)
        x = x + pos[0].permute(1, 2, 0).reshape(n, d)
        freqs = 1.0 / 10000.0 ** (torch.arange(0, hd, 4, device=device)[: hd // 4].float() / hd)
        rows, cols = torch.div(torch.arange(n, device=device), wd, rounding_mode="floor"), torch.arange(n, device=device) % wd
        angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], -1).reshape(n, hd // 2)
        turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]

        def rope(z):
            return torch.view_as_real(torch.view_as_complex(z.float().reshape(n, heads, -1, 2)) * turn).flatten(-2).type_as(z)

        for b in blocks:
            qkv = (F.rms_norm(x, (d,), b["norm0"]) @ b["wqkv"].T).reshape(n, 3, heads, hd)
            q, k, v = (t.transpose(0, 1)[None] for t in (rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]))
            out = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, -1)
            x = x + out @ b["wo"].T
            x = x + F.gelu(F.rms_norm(x, (d,), b["norm1"]) @ b["fc0"].T, approximate="tanh") @ b["fc1"].T
        x = F.rms_norm(x, (d,), w["final"])
        merged = x.view(1, h // 2, 2, wd // 2, 2, d).permute(0, 1, 3, 2, 4, 5).mean(0)
        return merged.reshape((h // 2) * (wd // 2), 4 * d)

    return run


def rmsnorm_eps_probe(device: str) -> float:
    """The eps torch's nn.RMSNorm (no eps given) adds in bf16, recovered from y = x / sqrt(x^2 + eps)
    at x = 0.01: about 2^-7 = 7.8e-3 if it is bf16's machine epsilon; within +-1e-6 of 0 if float32's."""
    import torch

    x = torch.full((1, 8), 0.01, dtype=torch.bfloat16, device=device)
    y = float(torch.nn.RMSNorm(8, device=device, dtype=torch.bfloat16)(x)[0, 0])
    value = float(x[0, 0])
    return value**2 / y**2 - value**2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny golden config, fp32, small images")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)

    config = REPO / ("tests/golden/k3-tiny-a" if args.smoke else "configs/kimi_k3.json")
    cfg = K3Config.from_hf(config).vision
    dtype = "float32" if args.smoke else "bfloat16"
    images = SMOKE_IMAGES if args.smoke else IMAGES
    tolerance = FP32_TOLERANCE if args.smoke else BF16_TOLERANCE
    tower = VisionTower(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    try:
        import torch
    except ImportError:
        torch = None
    device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    peer = torch_tower(weights_of(tower), cfg, dtype, device) if torch is not None else None
    result = {"config": str(config.relative_to(REPO)), "dtype": dtype, "device": str(jax.devices()[0]), "rows": []}
    if torch is not None:
        result["torch_rmsnorm_eps_bf16"] = rmsnorm_eps_probe(device)

    for name, grid in images.items():
        grids = (grid,)
        run = jax.jit(lambda m, x, g=grids: m(x, g))
        patches = math.prod(grid)
        pixels = np.random.default_rng(1).uniform(-1, 1, (patches, 3, cfg.patch_size, cfg.patch_size)).astype(np.float32)
        ours = np.asarray(run(tower, jnp.asarray(pixels)).astype(jnp.float32))
        row = {"image": name, "grid": list(grid), "patches": patches, "tokens": patches // 4}
        if peer is not None:
            x = torch.tensor(pixels, device=device)
            theirs = peer(x, grid).float().cpu().numpy()
            row["rel_rms_vs_torch"] = rel_rms(ours, theirs)
            if row["rel_rms_vs_torch"] > tolerance:
                raise SystemExit(f"{name}: JAX and torch towers disagree (rel-RMS {row['rel_rms_vs_torch']:.2e} "
                                 f"> {tolerance:g}); not timing")
        row["jax_ms"] = median_ms(run, tower, jnp.asarray(pixels), reps=args.reps)
        if peer is not None:
            if device == "cuda":
                from benchmarks.torch_peer import do_bench_ms

                row["torch_sdpa_ms"] = do_bench_ms(lambda: peer(x, grid))[0]
            else:
                import time

                start = time.perf_counter()
                peer(x, grid)
                row["torch_sdpa_ms"] = (time.perf_counter() - start) * 1e3
        result["rows"].append(row)

    print(f"MoonViT-V2 tower, {result['config']}, {dtype}, {result['device']}\n")
    print("| image | grid | patches | tokens | JAX ms | torch SDPA ms | rel-RMS vs torch |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        torch_ms = f"{r['torch_sdpa_ms']:.2f}" if "torch_sdpa_ms" in r else "-"
        error = f"{r['rel_rms_vs_torch']:.1e}" if "rel_rms_vs_torch" in r else "-"
        print(f"| {r['image']} | {r['grid']} | {r['patches']} | {r['tokens']} | {r['jax_ms']:.2f} | {torch_ms} | {error} |")
    if "torch_rmsnorm_eps_bf16" in result:
        print(f"\ntorch nn.RMSNorm eps in bf16 (no eps given): {result['torch_rmsnorm_eps_bf16']:.3g}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
