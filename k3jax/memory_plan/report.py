"""The human report of a memory plan: mesh, state bytes, one line per program, verdict.

Bytes are decimal GB with two decimals throughout, as HBM sizes are quoted, so columns compare at a
glance.
"""

from __future__ import annotations

from k3jax.memory_plan.plan import MemoryPlan
from k3jax.units import format_bytes


def _gb(n: float) -> str:
    return format_bytes(n, "GB")


def format_memory_plan(plan: MemoryPlan) -> str:
    s = plan.state
    depth = (f"full depth ({plan.layers} layers) compiled" if len(plan.compiled_layers) == 1 else
             f"extrapolated to {plan.layers} layers from compiles at {plan.compiled_layers[0]} and "
             f"{plan.compiled_layers[1]} layers (linear in depth)")
    experts = ("MXFP4 packed (uint8 codes + E8M0 scales, 4.25 bits/weight, model storage)"
               if plan.experts == "mxfp4" else "bf16")
    gemms = ("device-like stand-in (no CPU [groups, rows, K] expansion; see memory_plan.plan.DEVICE_KERNELS)"
             if plan.kernels.moe == "xla_memory_standin" else
             f"{plan.kernels.moe or 'policy'} implementation (on CPU: lax.ragged_dot's dense per-group expansion)")
    lines = [
        f"== k3jax memory plan: mesh {plan.mesh} ({plan.devices} devices), HBM {_gb(plan.hbm)} per device",
        f"batch {plan.batch}, cache capacity {plan.max_len} tokens, prefill chunk {plan.seq_len} tokens; {depth}",
        f"routed experts: {experts}",
        f"grouped GEMMs: {gemms}",
        "",
        "== state per device (exact, from the shardings)",
        f"parameters  {_gb(s['params']):>12}   (of {_gb(s['params_total'])} in all)",
        f"caches      {_gb(s['cache']):>12}   (of {_gb(s['cache_total'])} in all: KDA state + conv, MLA latent)",
    ]
    if "optimizer" in s:
        lines.append(f"optimizer   {_gb(s['optimizer']):>12}   (adamw mu + nu, sharded like the parameters)")
    columns = ("arguments", "outputs", "aliased", "temporaries", "peak")
    lines += ["", "== programs per device (compiled.memory_analysis)",
              f"{'program':<8} " + " ".join(f"{c:>12}" for c in columns) + "  compile s"]
    for p in plan.programs:
        lines.append(f"{p.name:<8} {_gb(p.argument):>12} {_gb(p.output):>12} {_gb(p.alias):>12} "
                     f"{_gb(p.temp):>12} {_gb(p.peak):>12}  {p.seconds:8.1f}")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += ["", f"== verdict: {verdict}: peak {_gb(plan.peak)} per device vs HBM {_gb(plan.hbm)} "
                  f"({100 * plan.peak / plan.hbm:.0f}%); planned in {plan.seconds:.0f} s"]
    return "\n".join(lines)
