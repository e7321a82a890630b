"""Memory plan: compile K3's prefill and decode, or its fine-tuning step (full or LoRA, as
`k3jax.training.Trainer` runs it: `train`), for a mesh that need not exist, and say whether each
device's share fits its HBM.

Why compile instead of adding up shapes: parameter and cache bytes follow from the shardings alone, but
the temporaries (the decoded MXFP4 experts of one layer, attention scores, MoE dispatch buffers,
all-gathered FSDP weights, backward residuals) only exist in the partitioned XLA program. So the planner
builds an abstract model (nothing allocated), attaches the `sharding` package's NamedShardings to every
ShapeDtypeStruct (`state`), lowers the programs (`programs`) and compiles them on fake CPU devices
shaped like the mesh (`devices`), and reads `compiled.memory_analysis()`, which describes ONE device's
partition of the SPMD program (`measure`). FITS when every program's peak is <= the HBM (`plan`,
`report`; the command: `command`).

CPU caveat: the CPU compiler is not the GPU/TPU one (different fusion, bf16 dots run in fp32), so temps
are an estimate of the same program's working set, not a measurement of a GPU allocation.

    ensure_cpu_devices(sharding.mesh_device_count("expert=8,tensor=4"))   # before JAX starts its backend
    plan = plan_memory(K3Config.from_hf("configs/kimi_k3.json"), "expert=8,tensor=4", parse_bytes("141GB"))
    print(format_memory_plan(plan))
"""

from k3jax.memory_plan.devices import ensure_cpu_devices
from k3jax.memory_plan.measure import Program
from k3jax.memory_plan.plan import CPU_KERNELS, DEVICE_KERNELS, MemoryPlan, plan_memory, reduced_config
from k3jax.memory_plan.report import format_memory_plan

__all__ = [
    "CPU_KERNELS", "DEVICE_KERNELS", "MemoryPlan", "Program", "ensure_cpu_devices", "format_memory_plan",
    "plan_memory", "reduced_config",
]
