"""Memory plan: compile K3's prefill, decode (and a train step) for a mesh that need not exist, and say
whether each device's share fits its HBM.

Why compile instead of adding up shapes: parameter and cache bytes follow from the shardings alone, but
the temporaries (the decoded MXFP4 experts of one layer, attention scores, MoE dispatch buffers,
all-gathered FSDP weights, backward residuals) only exist in the partitioned XLA program. So the planner
builds an abstract model (`nnx.eval_shape`, nothing allocated), attaches the `sharding` package's
NamedShardings to every ShapeDtypeStruct, lowers and compiles on fake CPU devices shaped like the mesh,
and reads `compiled.memory_analysis()`, which describes ONE device's partition of the SPMD program.

Per program, peak bytes per device = arguments + outputs - aliased (donated) + temporaries, XLA's own
accounting. FITS when every program's peak is <= --hbm.

Fake devices: the process needs as many CPU devices as the mesh has. `ensure_cpu_devices` sets
`jax_platforms=cpu` and `jax_num_cpu_devices` before JAX creates its backend (the `k3jax plan` command
does this first thing; in a process whose backend already exists it raises and says to run a fresh one
or set XLA_FLAGS=--xla_force_host_platform_device_count=N).

Depth: with `layers` set, the programs are compiled at two reduced depths (`layers` and `layers` + one
scanned group) with the full width, and every memory_analysis figure is extrapolated linearly in the
number of layers to the configured depth. The layer scan makes per-layer costs exactly linear (one
group body, stacked weights and caches), so two points determine the line; benchmarks/RESULTS.md
checks the extrapolation against a full-depth compile. Parameter and cache bytes are always exact
(full-depth abstract model).

CPU caveat: the CPU compiler is not the GPU/TPU one (different fusion, bf16 dots run in fp32), so temps
are an estimate of the same program's working set, not a measurement of a GPU allocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from typing import Any

GB = 10**9
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'141GB' -> 141e9, '95 GiB' -> 95 * 2**30 (GB is decimal, as HBM sizes are quoted)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {text!r}; write e.g. 141GB or 95GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    return f"{n / GB:.2f} GB"


def mesh_devices(spec: str) -> int:
    """Device count of a spec with explicit sizes ("expert=8,tensor=4" -> 32); -1 is not allowed here."""
    sizes = [int(p.partition("=")[2]) for p in spec.split(",") if p.strip()]
    if any(s < 1 for s in sizes):
        raise ValueError(f"mesh spec {spec!r}: the planner needs explicit axis sizes (no -1)")
    return math.prod(sizes)


def ensure_cpu_devices(n: int) -> None:
    """Make this process's JAX backend CPU with at least `n` devices; must run before JAX initialises."""
    import jax  # noqa: PLC0415

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # the backend already exists
        if len(jax.devices()) < n:
            raise RuntimeError(
                f"the mesh needs {n} devices but JAX is already initialised with {len(jax.devices())}; run the "
                f"planner in a fresh process or set XLA_FLAGS=--xla_force_host_platform_device_count={n}"
            ) from err
    if len(jax.devices()) < n:
        raise RuntimeError(f"asked for {n} CPU devices, JAX has {len(jax.devices())}")


# ---- grouped GEMMs as the accelerators run them ----------------------------------------------------


@contextlib.contextmanager
def device_grouped_gemm():
    """While lowering, replace `jax.lax.ragged_dot_general` by a stand-in of the same output, so the
    temporaries are those of a device grouped GEMM and not of the CPU lowering.

    Why: on CPU, JAX lowers ragged_dot by expanding the rows to a dense [groups, rows, K] operand
    (52 GB for one K3 prefill chunk of 1024 tokens at 448 local experts), which no GPU/TPU run has: the
    Pallas grouped GEMM (GPU) and XLA's native ragged dot read rows in place. The stand-in contracts the
    rows with the experts' sum over the group axis: same output shape and dtype, same decoded expert
    weights live, the group axis reduced locally where it is sharded (as expert-parallel dispatch keeps
    each device on its own experts) and no [groups, rows, K] buffer. FLOPs and numbers are not the model's;
    only memory is read from this program. `k3jax plan --cpu-ragged-dot` turns this off.
    """
    import jax  # noqa: PLC0415

    original = jax.lax.ragged_dot_general

    def stand_in(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                 preferred_element_type=None, **_):
        (lhs_c, rhs_c), batch = ragged_dot_dimension_numbers.dot_dimension_numbers
        (group,) = ragged_dot_dimension_numbers.rhs_group_dimensions
        summed = rhs.sum(axis=group, dtype=rhs.dtype)
        rhs_c = [d - (d > group) for d in rhs_c]
        return jax.lax.dot_general(lhs, summed, ((lhs_c, rhs_c), batch), precision=precision,
                                   preferred_element_type=preferred_element_type)

    jax.lax.ragged_dot_general = stand_in
    try:
        yield
    finally:
        jax.lax.ragged_dot_general = original


# ---- model, cache and programs ------------------------------------------------------------------


def reduced_config(cfg, layers: int):
    """`cfg` cut to `layers` layers, keeping the layer pattern: the first layers-1 kinds, then the last
    layer's kind (K3's extra final MLA), so the scan plan is head + fewer groups + the same tail."""
    if layers >= cfg.num_hidden_layers:
        return cfg
    kinds = tuple(cfg.mixer_kinds[: layers - 1]) + (cfg.mixer_kinds[-1],)
    return dataclasses.replace(cfg, num_hidden_layers=layers, mixer_kinds=kinds)


def abstract_model(cfg, experts: str):
    """Abstract K3Model; routed experts MXFP4-packed (uint8 codes + scales) or bf16."""
    from flax import nnx  # noqa: PLC0415

    from k3jax.model import K3Model  # noqa: PLC0415
    from k3jax.nn.moe import pack_routed_experts  # noqa: PLC0415

    if experts == "mxfp4":
        return nnx.eval_shape(lambda: pack_routed_experts(K3Model.init(cfg)))
    return nnx.eval_shape(lambda: K3Model.init(cfg))


def _sharded_leaves(tree, prefix_shardings):
    """Flat ShapeDtypeStructs of `tree` with the shardings of `prefix_shardings` (a prefix tree, as
    sharding.param_shardings / cache_shardings return) attached, plus the treedef to rebuild `tree`."""
    import jax  # noqa: PLC0415

    full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix_shardings, tree)
    leaves, treedef = jax.tree.flatten(tree)
    shardings = jax.tree.leaves(full)
    assert len(leaves) == len(shardings), (len(leaves), len(shardings))
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings)], treedef


def shard_bytes(leaves) -> int:
    """Bytes one device holds of sharded ShapeDtypeStructs (the largest shard: uneven splits round up)."""
    import numpy as np  # noqa: PLC0415

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


def total_bytes(leaves) -> int:
    import numpy as np  # noqa: PLC0415

    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)


@dataclasses.dataclass
class Program:
    name: str
    argument: int
    output: int
    alias: int
    temp: int
    seconds: float

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def _analyse(name: str, lowered_fn, device_gemm: bool = True) -> Program:
    t0 = time.perf_counter()
    with device_grouped_gemm() if device_gemm else contextlib.nullcontext():
        lowered = lowered_fn()
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    return Program(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes, time.perf_counter() - t0)


def _abstract_state(cfg, mesh, experts: str, batch: int, max_len: int):
    """(param leaves, model treedef, cache leaves, cache treedef), each leaf a sharded ShapeDtypeStruct."""
    import jax  # noqa: PLC0415

    from sharding import cache_shardings, param_shardings  # noqa: PLC0415

    model = abstract_model(cfg, experts)
    params, model_def = _sharded_leaves(model, param_shardings(model, mesh))
    cache = jax.eval_shape(lambda: model.empty_cache(batch, max_len))
    caches, cache_def = _sharded_leaves(cache, cache_shardings(cache, mesh))
    return params, model_def, caches, cache_def


def _optimizer_leaves(params, mesh, lr: float = 1e-4):
    """adamw state for `params` as sharded ShapeDtypeStructs: mu and nu like their params, the step count
    replicated. Returns (leaves, treedef, optimizer)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    if not all(jnp.issubdtype(p.dtype, jnp.floating) for p in params):
        raise ValueError("--train needs dense experts (--experts bf16): packed MXFP4 codes have no gradient")
    opt = optax.adamw(lr)
    opt_state = jax.eval_shape(opt.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(opt, lambda _, p: p.sharding, opt_state, params,
                                   transform_non_params=lambda _: replicated)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              for x, s in zip(jax.tree.leaves(opt_state), jax.tree.leaves(opt_sh))]
    return leaves, jax.tree.structure(opt_state), opt


def compile_programs(cfg, mesh, *, experts: str, batch: int, max_len: int, seq_len: int, train: bool,
                     lr: float = 1e-4, device_gemm: bool = True) -> tuple[list[Program], dict[str, int]]:
    """Compile prefill (a `seq_len`-token chunk into an empty cache of capacity `max_len`), one decode
    step (cache donated) and optionally a train step; returns the programs and exact state bytes."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    from k3jax.model import run_model  # noqa: PLC0415
    from sharding import DEFAULT_RULES, logical_to_spec  # noqa: PLC0415

    params, model_def, cache_leaves, cache_def = _abstract_state(cfg, mesh, experts, batch, max_len)
    batch_spec = logical_to_spec(("activation_batch", None), DEFAULT_RULES, mesh, (batch, 1))
    ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(mesh, batch_spec))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(*batch_spec[:1])))
    param_sh = [p.sharding for p in params]
    cache_sh = [c.sharding for c in cache_leaves]

    def prefill(p, ids):
        m = jax.tree.unflatten(model_def, p)
        out, new = run_model(m, ids, m.empty_cache(ids.shape[0], max_len))
        return out.logits[:, -1], jax.tree.leaves(new)  # serving keeps only the last position's logits

    def decode(p, c, tokens):
        m = jax.tree.unflatten(model_def, p)
        out, new = run_model(m, tokens[:, None], jax.tree.unflatten(cache_def, c))
        return out.logits[:, 0], jax.tree.leaves(new)

    programs = [
        _analyse("prefill", lambda: jax.jit(prefill, out_shardings=(None, cache_sh)).lower(params, ids), device_gemm),
        _analyse("decode", lambda: jax.jit(decode, out_shardings=(None, cache_sh), donate_argnums=1)
                 .lower(params, cache_leaves, tokens), device_gemm),
    ]
    state = {"params": shard_bytes(params), "params_total": total_bytes(params),
             "cache": shard_bytes(cache_leaves), "cache_total": total_bytes(cache_leaves)}
    if train:
        opt_leaves, opt_def, opt = _optimizer_leaves(params, mesh, lr)
        replicated = NamedSharding(mesh, PartitionSpec())

        def loss_fn(p, ids):
            m = jax.tree.unflatten(model_def, p)
            logits = run_model(m, ids[:, :-1])[0].logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        def train_step(p, o, ids):
            loss, grads = jax.value_and_grad(loss_fn)(p, ids)
            updates, o = opt.update(grads, jax.tree.unflatten(opt_def, o), p)
            return loss, optax.apply_updates(p, updates), jax.tree.leaves(o)

        train_ids = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32, sharding=ids.sharding)
        programs.append(_analyse("train", lambda: jax.jit(
            train_step, out_shardings=(replicated, param_sh, [o.sharding for o in opt_leaves]),
            donate_argnums=(0, 1)).lower(params, opt_leaves, train_ids), device_gemm))
        state["optimizer"] = shard_bytes(opt_leaves)
    return programs, state


# ---- the plan -------------------------------------------------------------------------------------


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
    device_gemm: bool = True

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(peak=self.peak, fits=self.fits)
        return d


def _extrapolate(a: Program, b: Program, la: int, lb: int, target: int) -> Program:
    """Linear in depth through (la, a) and (lb, b), evaluated at `target` layers."""
    t = (target - la) / (lb - la)
    f = lambda x, y: int(round(x + (y - x) * t))  # noqa: E731
    return Program(a.name, f(a.argument, b.argument), f(a.output, b.output), f(a.alias, b.alias),
                   f(a.temp, b.temp), a.seconds + b.seconds)


def plan_memory(cfg, mesh_spec: str, hbm: int, *, batch: int = 1, max_len: int = 131072, seq_len: int = 4096,
                train: bool = False, layers: int | None = None, experts: str = "mxfp4",
                device_gemm: bool = True) -> MemoryPlan:
    """Compile and measure; `layers` None = full depth, else extrapolate from `layers` and `layers`+period."""
    from k3jax.layer_plan import plan_layers  # noqa: PLC0415
    from sharding import make_mesh  # noqa: PLC0415

    start = time.perf_counter()
    mesh = make_mesh(mesh_spec)
    full = cfg.num_hidden_layers
    state = state_bytes(cfg, mesh, experts=experts, batch=batch, max_len=max_len, train=train)
    if layers is None or layers >= full:
        programs, _ = compile_programs(cfg, mesh, experts=experts, batch=batch, max_len=max_len, seq_len=seq_len,
                                       train=train, device_gemm=device_gemm)
        depths: tuple[int, ...] = (full,)
    else:
        layout, full_layout = plan_layers(reduced_config(cfg, layers).layer_kinds), plan_layers(cfg.layer_kinds)
        same = (layout.start, layout.period, len(layout.tail)) == (full_layout.start, full_layout.period,
                                                                   len(full_layout.tail))
        if layout.num_groups < 2 or not same:  # another layout is another program: nothing to extrapolate
            raise ValueError(
                f"--layers {layers} does not keep the full layout (head of {full_layout.start}, groups of "
                f"{full_layout.period}, tail of {len(full_layout.tail)}); use head + k*{full_layout.period} + tail "
                f"layers with k >= 2 ({full_layout.start + 2 * full_layout.period + len(full_layout.tail)} for this config)")
        period = layout.period
        la, lb = layers, layers + period
        pa, _ = compile_programs(reduced_config(cfg, la), mesh, experts=experts, batch=batch, max_len=max_len,
                                 seq_len=seq_len, train=train, device_gemm=device_gemm)
        pb, _ = compile_programs(reduced_config(cfg, lb), mesh, experts=experts, batch=batch, max_len=max_len,
                                 seq_len=seq_len, train=train, device_gemm=device_gemm)
        programs = [_extrapolate(a, b, la, lb, full) for a, b in zip(pa, pb)]
        depths = (la, lb)
    return MemoryPlan(mesh_spec, mesh.size, hbm, batch, max_len, seq_len, experts, full, depths, state, programs,
                      time.perf_counter() - start, device_gemm)


def state_bytes(cfg, mesh, *, experts: str, batch: int, max_len: int, train: bool) -> dict[str, int]:
    """Exact per-device parameter / cache / optimizer bytes of the full-depth model (no compile)."""
    params, _, caches, _ = _abstract_state(cfg, mesh, experts, batch, max_len)
    state = {"params": shard_bytes(params), "params_total": total_bytes(params),
             "cache": shard_bytes(caches), "cache_total": total_bytes(caches)}
    if train:
        state["optimizer"] = shard_bytes(_optimizer_leaves(params, mesh)[0])
    return state


def format_plan(plan: MemoryPlan) -> str:
    """The human report: mesh, state bytes, one line per program, verdict."""
    s = plan.state
    depth = (f"full depth ({plan.layers} layers) compiled" if len(plan.compiled_layers) == 1 else
             f"extrapolated to {plan.layers} layers from compiles at {plan.compiled_layers[0]} and "
             f"{plan.compiled_layers[1]} layers (linear in depth)")
    lines = [
        f"== k3jax memory plan: mesh {plan.mesh} ({plan.devices} devices), HBM {human(plan.hbm)} per device",
        f"batch {plan.batch}, cache capacity {plan.max_len} tokens, prefill chunk {plan.seq_len} tokens; {depth}",
        f"routed experts: {'MXFP4 packed (uint8 codes + E8M0 scales, 4.25 bits/weight, model storage)' if plan.experts == 'mxfp4' else 'bf16'}",
        "grouped GEMMs: " + ("device-like stand-in (no CPU [groups, rows, K] expansion; see device_grouped_gemm)"
                             if plan.device_gemm else "CPU lowering of lax.ragged_dot (dense per-group expansion)"),
        "",
        "== state per device (exact, from the shardings)",
        f"parameters  {human(s['params']):>12}   (of {human(s['params_total'])} in all)",
        f"caches      {human(s['cache']):>12}   (of {human(s['cache_total'])} in all: KDA state + conv, MLA latent)",
    ]
    if "optimizer" in s:
        lines.append(f"optimizer   {human(s['optimizer']):>12}   (adamw mu + nu, sharded like the parameters)")
    lines += ["", "== programs per device (compiled.memory_analysis)",
              f"{'program':<8} {'arguments':>12} {'outputs':>12} {'aliased':>12} {'temporaries':>12} {'peak':>12}  compile s"]
    for p in plan.programs:
        lines.append(f"{p.name:<8} {human(p.argument):>12} {human(p.output):>12} {human(p.alias):>12} "
                     f"{human(p.temp):>12} {human(p.peak):>12}  {p.seconds:8.1f}")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += ["", f"== verdict: {verdict}: peak {human(plan.peak)} per device vs HBM {human(plan.hbm)} "
                  f"({100 * plan.peak / plan.hbm:.0f}%); planned in {plan.seconds:.0f} s"]
    return "\n".join(lines)
