"""The model's KDA op on the GPU, in one job: the fused-activation op against the path it replaces
and fla-core's ``chunk_kda`` with its in-kernel activations.

At B4 T8192 H96 and B1 T32768 H16, K = V = 128, bf16 raw inputs (q, k, v, gate pre-activation,
beta logits; A_log [H] and dt_bias [H K] fp32; no initial state, as in training), it times:

  (a) ``kernel_fwd``: the fused forward kernel alone (``gpu_pipeline.gpu_chunk_kda_fused``);
  (b) ``op_fwd``: the model's op, ``chunk_kda_fused(..., implementation="pallas_gpu")``;
  (c) ``op_fwd_bwd``: the same with its VJP (gradients of every raw input, A_log and dt_bias);
  (d) ``previous_fwd`` / ``previous_fwd_bwd``: the path the model ran before, the activations as
      XLA ops (q, k rounded to bf16 after their norm) and ``chunk_kda(..., "pallas_gpu")``;
  (e) ``fla_fwd`` / ``fla_fwd_bwd``: fla ``chunk_kda(..., use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate, lower_bound=-5)``, when ``fla``
      imports (installed from the carried wheel).

Every path's output (and for the fwd+bwd paths every gradient) is compared with (b)'s and (c)'s;
the relative L2 differences go into the JSON and a path beyond the bf16 bounds (``OUT_TOL``,
``GRAD_TOL``) keeps no time. fla runs first at each shape (see ``time_fla``). Prints a markdown table; writes JSON to ``--out``.

    python3 -m pip install -q --no-deps --target /tmp/site fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/kda_model_path.py --shape 4,8192,96 --out $OUT/kda_b4.json
    PYTHONPATH=/tmp/site:. python3 benchmarks/kda_model_path.py --shape 1,32768,16 --out $OUT/kda_b1.json
    PYTHONPATH=. python3 benchmarks/kda_model_path.py --smoke --out /tmp/kda_smoke.json  # CPU

``--smoke``: tiny shapes on CPU in interpret mode, without fla, against the XLA op as well (to
show the script works, not for timing). fla's autotune results come from the repository's
archive as in ``kda_pallas_h200.py`` (``FLA_AUTOTUNE``; a GPU other than the archive's autotunes
on its first call per shape).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

from benchmarks.torch_peer import TUNED_ARCHIVE  # noqa: E402

SHAPES = [(4, 8192, 96), (1, 32768, 16)]  # (B, T, H)
D = 128
SMOKE_SHAPES = [(1, 70, 2)]
SMOKE_D = 32
LB = -5.0
OUT_TOL, GRAD_TOL = 2e-2, 5e-2  # bf16 paths against each other: a few bf16 roundings apart
GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
FLA_AUTOTUNE = os.environ.get("FLA_AUTOTUNE", str(TUNED_ARCHIVE))


def jax_paths():
    """``{name: (jitted fn, takes the output cotangent)}`` of our paths (a)-(d)."""
    import jax

    from pallas_kernels.kda import activate, chunk_kda, chunk_kda_fused
    from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda_fused

    def op(*a):
        return chunk_kda_fused(*a, lower_bound=LB, implementation="pallas_gpu")[0]

    def previous(q, k, v, g, beta, A_log, dt_bias):
        qa, ka, ga, ba = activate(q, k, g, beta, A_log, dt_bias, lower_bound=LB)
        return chunk_kda(qa.astype(q.dtype), ka.astype(k.dtype), v, ga, ba, lower_bound=LB,
                         implementation="pallas_gpu")[0]

    def with_vjp(f):
        def run(*a):
            o, pull_back = jax.vjp(f, *a[:7])
            return o, pull_back(a[7])
        return jax.jit(run)

    return {
        "kernel_fwd": jax.jit(lambda *a: gpu_chunk_kda_fused(*a, lower_bound=LB)[0]),
        "op_fwd": jax.jit(op),
        "op_fwd_bwd": with_vjp(op),
        "previous_fwd": jax.jit(previous),
        "previous_fwd_bwd": with_vjp(previous),
        "xla_fwd": jax.jit(lambda *a: chunk_kda_fused(*a, lower_bound=LB, implementation="xla")[0]),
        "xla_fwd_bwd": with_vjp(
            lambda *a: chunk_kda_fused(*a, lower_bound=LB, implementation="xla")[0]),
    }


def inputs(B, T, H, d):
    """Raw bf16 q, k, v, gate pre-activation, beta logits, A_log [H], dt_bias [H d] and an output
    cotangent, as K3's layer passes them."""
    import jax
    import jax.numpy as jnp

    key = jax.random.split(jax.random.PRNGKey(0), 8)
    bf = lambda i, *s: jax.random.normal(key[i], s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    return (bf(0, B, T, H, d), bf(1, B, T, H, d), bf(2, B, T, H, d), bf(3, B, T, H, d),
            bf(4, B, T, H), jax.random.uniform(key[5], (H,), jnp.float32, -1, 1),
            0.5 * jax.random.normal(key[6], (H * d,), jnp.float32), bf(7, B, T, H, d))


def rel(a, b) -> float:
    import jax.numpy as jnp

    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def fla_paths():
    """``{name: fn(torch inputs) -> outputs}`` for fla's fused call, or None without fla."""
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None

    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB)

    def fwd(q, k, v, g, beta, A_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **kw)[0]

    def fwd_bwd(q, k, v, g, beta, A_log, dt_bias, do):
        leaves = (q, k, v, g, beta, A_log, dt_bias)
        o = fwd(*leaves)
        grads = torch.autograd.grad(o, leaves, do, allow_unused=True)
        return o, tuple(torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads))

    def fwd_no_grad(*a):
        with torch.no_grad():  # as ours: no residuals kept for a backward
            return fwd(*a)

    return {"fla_fwd": fwd_no_grad, "fla_fwd_bwd": fwd_bwd}


def to_torch(args):
    """The same device arrays as torch tensors (DLPack: no copy), leaves that take gradients."""
    import torch

    return tuple(torch.from_dlpack(a).clone().requires_grad_(i < 7) for i, a in enumerate(args))


def to_jax(t):
    import jax

    return jax.dlpack.from_dlpack(t.detach().contiguous())


def time_fla(fla, torch_args, r, save):
    """fla's outputs and times, taken before our paths allocate: JAX keeps what it allocated for
    reuse, so the peer runs first and hands its cached memory back (``empty_cache``)."""
    import torch

    from benchmarks.torch_peer import do_bench_ms

    outputs = {}
    for key, fn in fla.items():
        call = (lambda fn=fn, key=key: fn(*(torch_args if key.endswith("bwd") else torch_args[:7])))
        try:
            out = call()
            if key.endswith("bwd"):
                outputs[key] = (to_jax(out[0]), tuple(to_jax(g) for g in out[1]))
            else:
                outputs[key] = to_jax(out)
            del out
            r[f"{key}_ms"] = round(do_bench_ms(call)[0], 4)
        except Exception:
            r[f"{key}_error"] = traceback.format_exc()[-2000:]
        torch.cuda.synchronize()
        save()
    torch.cuda.empty_cache()
    return outputs


def measure(shape, d, smoke, paths, fla, res, save):
    """Every path's outputs, their agreement with the op's, then the timings, at one shape; results
    into ``res[name]``. A path whose outputs disagree keeps no time."""
    import jax

    from benchmarks.timing import median_ms

    B, T, H = shape
    name = f"B{B}_T{T}_H{H}_D{d}"
    r = res.setdefault(name, {})
    args = inputs(B, T, H, d)
    reps = dict(reps=1, inner=1) if smoke else dict(reps=5, inner=5)
    outputs = {} if fla is None else time_fla(fla, to_torch(args), r, save)
    for key in [k for k in paths if smoke or not k.startswith("xla")]:
        try:
            fn = paths[key]
            out = fn(*args) if key.endswith("bwd") else fn(*args[:7])
            outputs[key] = jax.block_until_ready(out)
        except Exception:
            r[f"{key}_error"] = traceback.format_exc()[-2000:]

    agree = r.setdefault("agreement", {})
    ok = {}
    for key, out in outputs.items():
        base = outputs.get("op_fwd_bwd" if key.endswith("bwd") else "op_fwd")
        if base is None:
            continue
        if key.endswith("bwd"):
            agree[f"{key}_o"] = rel(out[0], base[0])
            for n, g, g0 in zip(GRAD_NAMES, out[1], base[1]):
                agree[f"{key}_d{n}"] = rel(g, g0)
            ok[key] = agree[f"{key}_o"] <= OUT_TOL and all(
                agree[f"{key}_d{n}"] <= GRAD_TOL for n in GRAD_NAMES)
        else:
            agree[key] = rel(out, base)
            ok[key] = agree[key] <= OUT_TOL
    r["agree"] = ok
    fla_keys = [key for key in outputs if key.startswith("fla")]
    for key in fla_keys:
        if not ok.get(key, False):
            r[f"{key}_ms"] = None
    for key in fla_keys:
        del outputs[key]
    save()

    for key in list(outputs):
        if not ok.get(key, False):
            r[f"{key}_ms"] = None
            continue
        try:
            call_args = args if key.endswith("bwd") else args[:7]
            r[f"{key}_ms"] = round(median_ms(paths[key], *call_args, **reps), 4)
        except Exception:
            r[f"{key}_error"] = traceback.format_exc()[-2000:]
        save()
    del args, outputs


COLUMNS = [("(a) fused kernel fwd", "kernel_fwd"), ("(b) op fwd", "op_fwd"),
           ("(c) op fwd+bwd", "op_fwd_bwd"), ("(d) previous fwd", "previous_fwd"),
           ("(d) previous fwd+bwd", "previous_fwd_bwd"), ("(e) fla fwd", "fla_fwd"),
           ("(e) fla fwd+bwd", "fla_fwd_bwd")]


def table(res) -> str:
    """Markdown: one row per shape, one column per path (ms; "-" not run, "x" outputs disagree)."""
    rows = ["| shape | " + " | ".join(c for c, _ in COLUMNS) + " |",
            "|---" * (len(COLUMNS) + 1) + "|"]
    for shape, r in res.items():
        if shape == "env":
            continue
        cells = []
        for _, key in COLUMNS:
            ms = r.get(f"{key}_ms")
            cells.append("-" if f"{key}_ms" not in r else ("x" if ms is None else f"{ms:.3f}"))
        rows.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU in interpret mode, without fla")
    parser.add_argument("--shape", default=None,
                        help="B,T,H: this shape only (one process per shape keeps the peer's memory "
                             "apart from what JAX holds for the shapes before)")
    a = parser.parse_args()
    if a.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        from benchmarks.torch_peer import export_autotuning, keep_autotuning

        tuning = keep_autotuning(FLA_AUTOTUNE)
    import jax

    res = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0]), "smoke": a.smoke}}

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    fla = None if a.smoke else fla_paths()
    res["env"]["fla"] = fla is not None
    paths = jax_paths()
    t0 = time.time()
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    if a.shape:
        shapes = [tuple(int(x) for x in a.shape.split(","))]
    for shape in shapes:
        try:
            measure(shape, SMOKE_D if a.smoke else D, a.smoke, paths, fla, res, save)
        except Exception:
            res[f"B{shape[0]}_T{shape[1]}_H{shape[2]}_error"] = traceback.format_exc()[-3000:]
        save()
        print(f"{shape} done at {time.time() - t0:.0f} s", flush=True)
    if not a.smoke:
        export_autotuning(tuning, os.path.join(os.path.dirname(os.path.abspath(a.out)),
                                               "fla_autotune.tar.gz"))
    print(table(res))
    print(json.dumps({k: v.get("agreement") for k, v in res.items() if isinstance(v, dict)
                      and "agreement" in v}, indent=1))


if __name__ == "__main__":
    main()
