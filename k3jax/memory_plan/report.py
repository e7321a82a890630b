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
    head = f"== k3jax memory plan: mesh {plan.mesh} ({plan.devices} devices), HBM {_gb(plan.hbm)} per device"
    if plan.train is None:
        lines = [
            head,
            f"batch {plan.batch}, cache capacity {plan.max_len} tokens, prefill chunk {plan.seq_len} tokens; {depth}",
            f"routed experts: {experts}",
            f"grouped GEMMs: {gemms}",
            "",
            "== state per device (exact, from the shardings)",
            f"parameters  {_gb(s['params']):>12}   (of {_gb(s['params_total'])} in all)",
            f"caches      {_gb(s['cache']):>12}   (of {_gb(s['cache_total'])} in all: KDA state + conv, MLA latent)",
        ]
    else:
        lines = [head, *_train_header(plan, depth, experts, gemms)]
    columns = ("arguments", "outputs", "aliased", "temporaries", "peak")
    lines += ["", "== programs per device (compiled.memory_analysis; temporaries = activations and other scratch)",
              f"{'program':<8} " + " ".join(f"{c:>12}" for c in columns) + "  compile s"]
    for p in plan.programs:
        lines.append(f"{p.name:<8} {_gb(p.argument):>12} {_gb(p.output):>12} {_gb(p.alias):>12} "
                     f"{_gb(p.temp):>12} {_gb(p.peak):>12}  {p.seconds:8.1f}")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += ["", f"== verdict: {verdict}: peak {_gb(plan.peak)} per device vs HBM {_gb(plan.hbm)} "
                  f"({100 * plan.peak / plan.hbm:.0f}%); planned in {plan.seconds:.0f} s"]
    return "\n".join(lines)


def _train_header(plan: MemoryPlan, depth: str, experts: str, gemms: str) -> list[str]:
    """What a train plan compiles and the state the trainer holds (k3jax.training.Trainer)."""
    s = plan.state
    if plan.train == "lora":
        what = (f"LoRA rank {plan.lora_rank} on the default targets: fp32 adapters trained (AdamW), the base "
                f"frozen as loaded, gradients w.r.t. the adapters only")
        frozen = "the base model as loaded"
        trained = "fp32 LoRA adapters"
    else:
        what = "full fine-tuning: every float parameter trained as an fp32 master (AdamW), cast per step"
        frozen = "integer leaves, never trained"
        trained = "fp32 masters of every float parameter"
    return [
        f"train step (k3jax.training.Trainer): {what}; remat {plan.remat}",
        f"batch {plan.batch} rows of {plan.seq_len} tokens (packed documents); {depth}",
        f"routed experts: {experts}",
        f"grouped GEMMs: {gemms}",
        "",
        "== state per device (exact, from the shardings)",
        f"frozen      {_gb(s['frozen']):>12}   (of {_gb(s['frozen_total'])} in all: {frozen})",
        f"trained     {_gb(s['trained']):>12}   (of {_gb(s['trained_total'])} in all: {trained})",
        f"optimizer   {_gb(s['optimizer']):>12}   (of {_gb(s['optimizer_total'])} in all: AdamW mu + nu, fp32, "
        f"laid out like the trained leaves)",
        f"other       {_gb(s['other']):>12}   (step, rng, router biases)",
        f"unread      {_gb(s['unread']):>12}   (part of frozen: the vision tower and projector, held but not "
        f"arguments of the text step; added to the peak)",
    ]
