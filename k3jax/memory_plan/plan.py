"""`plan_memory`: every program's per-device peak on a mesh, at the configured depth, and the verdict.

Without `train` the programs are prefill and decode (`programs`); with `train` ("full" or "lora") the
one program is the fine-tuning step as `k3jax.training.Trainer` runs it (`train`), and the state is
what the trainer holds (frozen weights, fp32 trained leaves, optimizer state).

With `layers` set, the programs are compiled at two reduced depths (`layers` and `layers` + one
scanned group) with the full width and every figure is extrapolated linearly to the configured depth
(`measure.extrapolate`); benchmarks/RESULTS.md checks the extrapolation against a full-depth compile.
Parameter, cache, trained and optimizer bytes are always exact (full-depth abstract model).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.layer_plan import plan_layers
from k3jax.memory_plan.measure import Program, extrapolate, measure
from k3jax.memory_plan.programs import lowerings
from k3jax.memory_plan.state import state_bytes
from k3jax.memory_plan.train import abstract_trainer, train_config, train_lowering
from k3jax.prefill_chunk import default_chunk_size
from sharding import make_mesh

# The routed experts' grouped GEMMs as a device runs them: CPU XLA lowers ragged_dot by expanding the
# rows to a dense [groups, rows, K] operand that no GPU/TPU run has (the Pallas grouped GEMMs and
# XLA's native ragged dot read rows in place), so the plan compiles a stand-in of the same output,
# the same live decoded expert weights and no such buffer (its numbers are not the model's: only
# memory is read from these programs). Everything else runs the XLA reference, as on CPU.
DEVICE_KERNELS = Kernels(kda="xla", kda_decode="xla", moe="xla_memory_standin")
# `k3jax plan --cpu-ragged-dot`: keep the CPU lowering of the grouped GEMMs.
CPU_KERNELS = Kernels(kda="xla", kda_decode="xla", moe="xla")


@dataclasses.dataclass
class MemoryPlan:
    mesh: str
    devices: int
    hbm: int
    batch: int
    max_len: int
    seq_len: int
    experts: str
    layers: int  # configured depth the figures are for
    compiled_layers: tuple[int, ...]  # depths actually compiled (one entry: no extrapolation)
    state: dict[str, int]
    programs: list[Program]
    seconds: float
    kernels: Kernels = DEVICE_KERNELS
    train: str | None = None  # None: prefill and decode; "full" / "lora": the fine-tuning step
    lora_rank: int | None = None  # adapters' rank with train="lora"
    remat: str | None = None  # the train step's remat policy ("none" or a jax.checkpoint_policies name)

    @property
    def peak(self) -> int:
        """The largest program's peak, plus what stays resident without being any program's argument
        (a train plan's "unread" frozen bytes: the vision tower and projector)."""
        return max(p.peak for p in self.programs) + self.state.get("unread", 0)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(peak=self.peak, fits=self.fits)
        return d


def reduced_config(cfg: K3Config, layers: int) -> K3Config:
    """`cfg` cut to `layers` layers, keeping the layer pattern: the first layers-1 kinds, then the last
    layer's kind (K3's extra final MLA), so the scan plan is head + fewer groups + the same tail."""
    if layers >= cfg.num_hidden_layers:
        return cfg
    kinds = tuple(cfg.mixer_kinds[: layers - 1]) + (cfg.mixer_kinds[-1],)
    return dataclasses.replace(cfg, num_hidden_layers=layers, mixer_kinds=kinds)


def plan_memory(cfg: K3Config, mesh_spec: str, hbm: int, *, batch: int = 1, max_len: int = 131072,
                seq_len: int | None = None, train: str | None = None, lora_rank: int = 16, remat: str = "none",
                layers: int | None = None, experts: str = "mxfp4", kernels: Kernels = DEVICE_KERNELS) -> MemoryPlan:
    """Compile and measure on the devices of `mesh_spec` (see `ensure_cpu_devices`); `layers` None =
    full depth, else extrapolate from `layers` and `layers` + one scanned group. `seq_len` None: the
    prefill chunk `k3jax.prefill` uses on a device of `hbm` bytes (`default_chunk_size`), at most
    `max_len`. `train` "full" / "lora": plan the fine-tuning step instead (`batch` rows of `seq_len`
    tokens; `lora_rank` adapters in "lora"; `remat` as `TrainConfig.remat`)."""
    if seq_len is None:
        seq_len = min(default_chunk_size(cfg, batch, hbm), max_len)
    start = time.perf_counter()
    mesh = make_mesh(mesh_spec)
    full = cfg.num_hidden_layers
    shape = dict(experts=experts, batch=batch, max_len=max_len, kernels=kernels)
    config = None if train is None else train_config(train, lora_rank=lora_rank, remat=remat)
    if config is None:
        state = state_bytes(cfg, mesh, **shape)
    else:
        state = abstract_trainer(cfg, mesh, experts=experts, kernels=kernels, config=config).bytes()

    def programs_at(depth_cfg: K3Config) -> list[Program]:
        if config is not None:
            planned = abstract_trainer(depth_cfg, mesh, experts=experts, kernels=kernels, config=config)
            return [measure("train", train_lowering(planned, mesh, batch=batch, seq_len=seq_len))]
        return [measure(name, lower) for name, lower in lowerings(depth_cfg, mesh, seq_len=seq_len, **shape).items()]

    if layers is None or layers >= full:
        programs, depths = programs_at(cfg), (full,)
    else:
        layout, full_layout = plan_layers(reduced_config(cfg, layers).layer_kinds), plan_layers(cfg.layer_kinds)
        same = (layout.start, layout.period, len(layout.tail)) == (full_layout.start, full_layout.period,
                                                                   len(full_layout.tail))
        if layout.num_groups < 2 or not same:  # another layout is another program: nothing to extrapolate
            smallest = full_layout.start + 2 * full_layout.period + len(full_layout.tail)
            raise ValueError(
                f"--layers {layers} does not keep the full layout (head of {full_layout.start}, groups of "
                f"{full_layout.period}, tail of {len(full_layout.tail)}); use head + k*{full_layout.period} + tail "
                f"layers with k >= 2 ({smallest} for this config)")
        la, lb = layers, layers + layout.period
        pa, pb = programs_at(reduced_config(cfg, la)), programs_at(reduced_config(cfg, lb))
        programs, depths = [extrapolate(a, b, la, lb, full) for a, b in zip(pa, pb)], (la, lb)
    return MemoryPlan(mesh_spec, mesh.size, hbm, batch, max_len, seq_len, experts, full, depths, state, programs,
                      time.perf_counter() - start, kernels, train, lora_rank if train == "lora" else None,
                      None if train is None else remat)
