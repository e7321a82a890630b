"""Sweep `k3jax plan` over candidate meshes for K3 (MXFP4 experts, batch 1) at 128K and 1M context and
print the README "Memory plan" table: per HBM size, the fewest devices with a fitting mesh and the mesh
(among those at that count) with the lowest peak.

Each plan is its own process (the fake CPU device count is fixed per process); the compiles do not
depend on --hbm (the default prefill chunk is 8192 for K3 at both 141 GB and 95 GB), so one run per
(mesh, context) is judged against both H200 (141 GB) and TPU v5p (95 GB).

    PYTHONPATH=. python benchmarks/memory_plan_sweep.py [--jobs 2] [--out /tmp/plan_sweep]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> (HBM bytes per device, devices per host: a job books whole hosts)
HBM = {"H200 (141 GB)": (141e9, 8), "TPU v5p (95 GB)": (95e9, 4)}
HEADROOM = 0.9  # "recommended": peak <= 90% of HBM, room for the runtime, NCCL buffers and fragmentation
# context -> cache capacity. The prefill chunk is the planner's default (k3jax.prefill_chunk, the chunk
# `k3jax.prefill` uses on the device): MLA prefill attention is blockwise, so its temporaries no longer
# grow with chunk x context.
CONTEXTS = {"128K": 131072, "1M": 1048576}
# 896 experts = 2^7 * 7, so expert sizes divide 896; tensor <= 8 stays inside an H200 node.
MESHES = [
    "expert=2,tensor=8", "expert=4,tensor=4",                                   # 16
    "expert=7,tensor=4",                                                        # 28
    "expert=4,tensor=8", "expert=8,tensor=4", "fsdp=2,expert=2,tensor=8",       # 32
    "expert=7,tensor=8",                                                        # 56
    "expert=8,tensor=8", "fsdp=2,expert=4,tensor=8",                            # 64
    "expert=16,tensor=8",                                                       # 128
    "expert=32,tensor=8",                                                       # 256
]
# Context parallelism splits the MLA latent cache's positions over `context` (sharding/rules.py
# `cache_length`): tried at 1M, where the replicated cache is what does not fit.
CONTEXT_MESHES = [
    "context=2,expert=4,tensor=8", "context=4,expert=2,tensor=8",               # 64
    "context=2,expert=8,tensor=8", "context=4,expert=4,tensor=8",               # 128
    "context=2,expert=16,tensor=8", "context=4,expert=8,tensor=8", "context=8,expert=4,tensor=8",  # 256
]


def run_one(mesh: str, context: str, out: Path) -> dict:
    max_len = CONTEXTS[context]
    path = out / f"{context}_{mesh.replace(',', '_').replace('=', '')}.json"
    if not path.exists():
        cmd = [sys.executable, "-m", "k3jax", "plan", "--config", str(ROOT / "configs/kimi_k3.json"), "--mesh", mesh,
               "--hbm", "141GB", "--max-len", str(max_len), "--json", str(path)]
        subprocess.run(cmd, check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                       stdout=subprocess.DEVNULL)
    result = json.loads(path.read_text())
    print(f"{context:>5} {mesh:<28} peak {result['peak'] / 1e9:7.1f} GB  ({result['seconds']:.0f} s)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/plan_sweep"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(m, c) for c in CONTEXTS for m in MESHES] + [(m, "1M") for m in CONTEXT_MESHES]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_one(*j, args.out), jobs))
    print("\n| device (HBM) | context | min devices (mesh, peak/device) | recommended mesh (peak <= 90% HBM) "
          "| params / caches / prefill peak / decode peak per device, recommended (GB) |")
    print("|---|---|---|---|---|")
    for name, (hbm, per_host) in HBM.items():
        for context in CONTEXTS:
            runs = [r for r in results if r["max_len"] == CONTEXTS[context] and r["devices"] % per_host == 0]
            fewest = _fewest([r for r in runs if r["peak"] <= hbm])
            if fewest is None:
                low = min(runs, key=lambda r: r["peak"])
                print(f"| {name} | {context} | none up to {max(r['devices'] for r in runs)} (lowest peak "
                      f"{low['peak'] / 1e9:.1f} GB, `{low['mesh']}`) | - | - |")
                continue
            rec = _fewest([r for r in runs if r["peak"] <= HEADROOM * hbm])
            s, (pre, dec) = rec["state"], (p["argument"] + p["output"] - p["alias"] + p["temp"] for p in rec["programs"])
            print(f"| {name} | {context} | {fewest['devices']} (`{fewest['mesh']}`, {fewest['peak'] / 1e9:.1f} GB) | "
                  f"{rec['devices']}: `{rec['mesh']}` | {s['params'] / 1e9:.1f} / {s['cache'] / 1e9:.1f} / "
                  f"{pre / 1e9:.1f} / {dec / 1e9:.1f} |")


def _fewest(runs: list[dict]) -> dict | None:
    """The run with the fewest devices, ties broken by the lower peak."""
    return min(runs, key=lambda r: (r["devices"], r["peak"]), default=None)


if __name__ == "__main__":
    main()
