"""Expert-parallel dispatch strategies (sharding/expert_parallel.py) on 8 fake CPU devices, plus bytes moved.

    PYTHONPATH=. python benchmarks/ep_dispatch.py            # table on stdout, JSON in $OUT (or .)

Fake CPU devices share the host's cores and "communicate" by memcpy, so the times show each strategy's
overheads (sorting, padding, buffer copies, wasted rows) on this machine, not interconnect behaviour.
Bytes are counted analytically per device per step (what it sends; it receives as much by symmetry),
for the buffers as built: the padded all-to-all sends its whole worst-case buffer to its ep-1 peers.
Also printed: the per-token volume of each strategy at K3 shapes (top-16 of 896, latent 3584, bf16).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402
from pallas_kernels.moe.reference import experts_ragged_dot  # noqa: E402
from sharding import make_mesh  # noqa: E402
from sharding.expert_parallel import dispatch_bytes_per_token  # noqa: E402
from sharding.expert_parallel import ep_routed_experts  # noqa: E402

OUT = os.environ.get("OUT", ".")
MESH = "expert=8"
SHAPES = {"moderate": dict(n=4096, k=4, e=32, d=256, f=128), "decode": dict(n=8, k=4, e=32, d=256, f=128)}


def problem(n, k, e, d, f, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, d)).astype(np.float32)
    w1 = (r.normal(size=(e, f, d)) / d**0.5).astype(np.float32)
    w3 = (r.normal(size=(e, f, d)) / d**0.5).astype(np.float32)
    w2 = (r.normal(size=(e, d, f)) / f**0.5).astype(np.float32)
    ids = np.argsort(r.random((n, e)), axis=1)[:, :k].astype(np.int32)  # uniform routing
    weights = r.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    return tuple(map(jnp.asarray, (x, w1, w2, w3, weights, ids)))


def bytes_moved(strategy, *, n, k, e, d, ep, itemsize=4):
    """Bytes one device sends per step, buffers as built (padding included)."""
    if strategy == "reference":
        return 0
    if strategy == "decode":  # tokens replicated over expert: every device holds all n, psum of fp32 [n, d]
        per_token = dispatch_bytes_per_token("decode", ep=ep, k=k, num_experts=e, d_in=d, d_out=d, itemsize=itemsize)
        return per_token * n / ep
    n_loc = -(-n // ep)
    exchange = "padded" if strategy == "all_to_all" else "ragged"  # "all_to_all_ragged": not runnable on CPU
    if strategy == "all_to_all_ragged":
        strategy = "all_to_all"
    return n_loc * dispatch_bytes_per_token(strategy, ep=ep, k=k, num_experts=e, d_in=d, d_out=d,
                                            itemsize=itemsize, exchange=exchange)


def main():
    mesh = make_mesh(MESH)
    ep = mesh.shape["expert"]
    rows = []
    for label, s in SHAPES.items():
        args = problem(**s)
        ref = experts_ragged_dot(*args, beta=2.0, linear_beta=3.0)
        cases = {"reference": jax.jit(lambda *a: experts_ragged_dot(*a, beta=2.0, linear_beta=3.0))}
        for strategy in ("all_to_all", "allgather", "decode"):
            cases[strategy] = jax.jit(lambda *a, st=strategy: ep_routed_experts(
                *a, mesh=mesh, beta=2.0, linear_beta=3.0, strategy=st))
        for name, fn in cases.items():
            err = float(jnp.abs(fn(*args) - ref).max() / jnp.abs(ref).max())
            t = median_ms(fn, *args, warmups=2) / 1e3
            b = bytes_moved(name, n=s["n"], k=s["k"], e=s["e"], d=s["d"], ep=ep)
            rows.append(dict(shape=label, **s, strategy=name, median_ms=t * 1e3, bytes_per_device=b, max_rel_err=err))
            print(f"{label:9s} N={s['n']:5d} {name:11s} {t * 1e3:9.2f} ms  {b / 1e6:9.3f} MB/device  err {err:.1e}",
                  flush=True)
        b = bytes_moved("all_to_all_ragged", n=s["n"], k=s["k"], e=s["e"], d=s["d"], ep=ep)
        print(f"{label:9s} N={s['n']:5d} all_to_all with the ragged exchange (not on CPU): {b / 1e6:.3f} MB/device")

    k3 = dict(k=16, num_experts=896, d_in=3584, d_out=3584, itemsize=2)
    print("\nK3 (top-16 of 896, latent 3584, bf16 rows, fp32 combine), interconnect bytes per token (whole EP group):")
    k3_rows = []
    for ep_k3 in (8, 16, 32, 64):
        r = dict(ep=ep_k3,
                 all_to_all_ragged=dispatch_bytes_per_token("all_to_all", ep=ep_k3, exchange="ragged", **k3),
                 all_to_all_padded=dispatch_bytes_per_token("all_to_all", ep=ep_k3, exchange="padded", **k3),
                 allgather=dispatch_bytes_per_token("allgather", ep=ep_k3, **k3),
                 decode=dispatch_bytes_per_token("decode", ep=ep_k3, **k3))
        k3_rows.append(r)
        print("  " + "  ".join(f"{key}={v / 1e3:,.1f} KB" if key != "ep" else f"EP={v}" for key, v in r.items()))
    with open(os.path.join(OUT, "ep_dispatch.json"), "w") as fh:
        json.dump(dict(mesh=MESH, rows=rows, k3=k3_rows), fh, indent=1)


if __name__ == "__main__":
    main()
