"""Registers, spills and shared memory of the Pallas-Triton kernels on an H200 (sm_90), without a GPU.

Each case lowers a public entry point for CUDA on this machine (Pallas-Triton is told it targets an
H200), takes the Triton IR that every ``pallas_call`` embeds in its ``__gpu$xla.gpu.triton`` custom
call (MLIR bytecode in the ``ir`` field of the backend config), prints it with jaxlib's Triton
dialect, compiles that text for sm_90a with the ``triton`` package's own pipeline (TTIR -> TTGIR ->
LLVM -> PTX) using the call's num_warps / num_stages, and runs triton's bundled ptxas with ``-v``
(the flags triton itself uses) on the PTX. One row per kernel: registers per thread, spill
stores / loads in bytes (ptxas) and shared memory in bytes (triton's allocation, dynamic smem).
Triton caches its compiles (~/.triton/cache), so reruns of unchanged kernels are quick.

The numbers come from triton 3.6's pipeline and its bundled ptxas (CUDA 12.8); XLA compiles the
same IR with the Triton fork bundled in jaxlib and the ptxas of its CUDA install, so they can
differ a little from what runs on the GPU. Use them to compare kernel variants.

One known difference is folded here before compiling (``fold_accumulating_dots``): Pallas lowers
``acc + dot(a, b)`` to a dot with a splatted zero accumulator plus an ``arith.addf``, which
triton 3.6's combine pass leaves apart (the zeros are not a dense constant), so every GEMM k step
would wait for its wgmma and add into a second accumulator (the MoE gate+up kernel: 255 registers
instead of 176). On the H200 writing that dot with the accumulator inside (a custom lowering rule)
changed no timing (gate+up 545 vs 544 TFLOP/s, 2026-11-29), so XLA's pipeline evidently folds it.

No GPU or CUDA toolkit is needed; install triton next to jax (only for this tool, it is not a
project dependency):

    pip install triton==3.6.0
    PYTHONPATH=. python benchmarks/triton_regs.py [case ...] [--warps N]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
except ImportError:
    sys.exit("benchmarks/triton_regs.py needs the triton package: pip install triton==3.6.0")

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import gpu_info, pallas_call_registration

from pallas_kernels.kda.gpu_backward import gpu_chunk_kda_bwd
from pallas_kernels.kda.gpu_config import FEW_SEQUENCE_HEADS, chunk_config, default_inter
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda_fused
from pallas_kernels.platform import target
from pallas_kernels.moe.triton import grouped_gate_up_situ, grouped_matmul, grouped_matmul_tn

H200_CAPABILITY = 90
TARGET = GPUTarget("cuda", H200_CAPABILITY, 32)


@dataclass(frozen=True)
class TritonKernel:
    """One pallas_call as XLA would hand it to Triton."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Usage:
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


@contextlib.contextmanager
def h200_lowering() -> Iterator[None]:
    """Lower Pallas-Triton as on an H200 from a CPU-only process.

    Pallas asks for the GPU's compute capability (patched: no GPU here); the kernels are chosen as
    for a GPU (`platform.target`), not interpret mode or the XLA reference.
    """
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200), target("gpu"):
        yield


def _kernel_of(call: ir.Operation) -> TritonKernel:
    """Decode a custom call's backend config: the Triton module is MLIR bytecode, so it is parsed
    in a context with jaxlib's Triton dialect and printed as text (locations dropped)."""
    config = call.attributes["mhlo.backend_config"]
    context = mlir.make_ir_context()
    tt_dialect.register_dialect(context)
    with context:
        module = ir.Module.parse(config["ir"].value_bytes)
        ttir = module.operation.get_asm(enable_debug_info=False)
    return TritonKernel(
        name=ir.StringAttr(config["name"]).value,
        ttir=ttir,
        num_warps=ir.IntegerAttr(config["num_warps"]).value,
        num_stages=ir.IntegerAttr(config["num_stages"]).value,
    )


def triton_kernels(fn: Callable, args: tuple) -> list[TritonKernel]:
    """The distinct Triton kernels of ``fn(*args)`` lowered for CUDA, in program order."""
    with h200_lowering():
        module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    calls: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "stablehlo.custom_call":
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target == pallas_call_registration.CUSTOM_CALL_TARGET_NAME:
                calls.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    return list(dict.fromkeys(_kernel_of(call) for call in calls))


def _ptxas_number(log: str, pattern: str) -> int:
    match = re.search(pattern, log)
    if match is None:
        raise ValueError(f"ptxas -v output has no match for {pattern!r}:\n{log}")
    return int(match.group(1))


_DOT = re.compile(r"(\s*)(%\w+) = tt\.dot (%\w+), (%\w+), %\w+(.*)")
_ADDF = re.compile(r"(\s*)(%\w+) = arith\.addf (%[\w#]+), (%[\w#]+)\b")


def fold_accumulating_dots(ttir: str) -> str:
    """``d = addf(acc, dot(a, b, zeros))`` -> ``d = dot(a, b, acc)`` where the dot has no other use.

    The dot moves to the add's place, where a, b and acc are all defined. Text-level: the printed
    Triton IR has one op per line."""
    lines = ttir.splitlines()
    dots = {m.group(2): i for i, line in enumerate(lines) if (m := _DOT.match(line))}
    uses = {name: len(re.findall(re.escape(name) + r"\b", ttir)) - 1 for name in dots}
    for i, line in enumerate(list(lines)):
        add = _ADDF.match(line)
        if add is None:
            continue
        x, y = add.group(3), add.group(4)
        dot, acc = (y, x) if uses.get(y) == 1 else (x, y) if uses.get(x) == 1 else (None, None)
        if dot is None:
            continue
        j = dots[dot]
        d = _DOT.match(lines[j])
        lines[i] = f"{add.group(1)}{add.group(2)} = tt.dot {d.group(3)}, {d.group(4)}, {acc}{d.group(5)}"
        lines[j] = ""
    return "\n".join(lines)


def usage(kernel: TritonKernel) -> Usage:
    """Compile for sm_90 with triton, then rerun ptxas -v on the PTX: triton discards its log."""
    arch = sm_arch_from_capability(H200_CAPABILITY)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, f"{kernel.name}.ttir")  # the suffix tells triton where the pipeline starts
        src.write_text(fold_accumulating_dots(kernel.ttir))
        compiled = triton.compile(
            str(src), target=TARGET,
            options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
        )
        ptx = Path(tmp, f"{kernel.name}.ptx")
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run(
            [get_ptxas(H200_CAPABILITY).path, "-lineinfo", "-v", f"--gpu-name={arch}", str(ptx),
             "-o", str(Path(tmp, f"{kernel.name}.cubin"))],
            capture_output=True, text=True, check=True,
        ).stderr
    return Usage(
        registers=_ptxas_number(log, r"Used (\d+) registers"),
        spill_stores=_ptxas_number(log, r"(\d+) bytes spill stores"),
        spill_loads=_ptxas_number(log, r"(\d+) bytes spill loads"),
        shared_bytes=compiled.metadata.shared,
    )


# ---- cases ---------------------------------------------------------------------------------------

KDA_B, KDA_T, KDA_H, KDA_D = 1, 256, 2, 128
MOE_ROWS, MOE_HIDDEN, MOE_FFN, MOE_EXPERTS = 4096, 3584, 3072, 8
MOE_SMALL_GROUP_EXPERTS = 32  # 128 rows per expert: the small-group tiles (merged 32-row tails)
LOWER_BOUND = -5.0
sds = jax.ShapeDtypeStruct


def _kda_fwd(sequence_heads: int, warps: int | None) -> tuple[Callable, tuple]:
    """K3's forward call: raw bf16 q, k, gate and beta logits, activations fused in the kernel,
    with the inter stage ``default_inter`` picks for ``sequence_heads`` (the kernels themselves do
    not depend on B, T, H); ``warps``: the inter stage's, instead of its default."""
    tokens = (KDA_B, KDA_T, KDA_H, KDA_D)
    args = (sds(tokens, jnp.bfloat16),) * 4 + (
        sds((KDA_B, KDA_T, KDA_H), jnp.bfloat16),
        sds((KDA_H,), jnp.float32),
        sds((KDA_H * KDA_D,), jnp.float32),
    )
    inter, block_v, default_warps = default_inter(sequence_heads)

    def fn(*a: jax.Array) -> tuple[jax.Array, jax.Array]:
        config = chunk_config(*a[:4], inter=inter, block_v=block_v, num_warps=warps or default_warps)
        with target("gpu"):  # the GPU kernels, not interpret mode
            return gpu_chunk_kda_fused(*a, lower_bound=LOWER_BOUND, config=config)

    return fn, args


def _kda_bwd() -> tuple[Callable, tuple]:
    """The backward's own kernels (bf16, pre-activated gate) at the num_warps it picks."""
    tokens = (KDA_B, KDA_T, KDA_H, KDA_D)
    state = sds((KDA_B, KDA_H, KDA_D, KDA_D), jnp.float32)
    args = (sds(tokens, jnp.bfloat16),) * 4 + (sds((KDA_B, KDA_T, KDA_H), jnp.bfloat16), state,
                                               sds(tokens, jnp.bfloat16), state)

    def fn(*a: jax.Array) -> tuple[jax.Array, ...]:
        with target("gpu"):  # the GPU kernels, not interpret mode
            return gpu_chunk_kda_bwd(*a, scale=KDA_D**-0.5)

    return fn, args


def _moe_gate_up(experts: int = MOE_EXPERTS) -> tuple[Callable, tuple]:
    """The default tile config (num_warps included) for these shapes."""
    w = sds((experts, MOE_FFN, MOE_HIDDEN), jnp.bfloat16)
    x = sds((MOE_ROWS, MOE_HIDDEN), jnp.bfloat16)
    return grouped_gate_up_situ, (x, w, w, sds((experts,), jnp.int32))


def _moe_down(experts: int = MOE_EXPERTS) -> tuple[Callable, tuple]:
    """As ``_moe_gate_up``; x is the gate_up output, [rows, ffn]."""
    w = sds((experts, MOE_HIDDEN, MOE_FFN), jnp.bfloat16)
    x = sds((MOE_ROWS, MOE_FFN), jnp.bfloat16)
    return grouped_matmul, (x, w, sds((experts,), jnp.int32))


def _moe_weight_grads() -> tuple[Callable, tuple]:
    """The backward's dW1 = dg^T x per expert with its default tiles."""
    rows = sds((MOE_ROWS, MOE_FFN), jnp.bfloat16), sds((MOE_ROWS, MOE_HIDDEN), jnp.bfloat16)
    return grouped_matmul_tn, (*rows, sds((MOE_EXPERTS,), jnp.int32))


CASES: dict[str, Callable[[int | None], tuple[Callable, tuple]]] = {
    "kda_fwd": lambda warps: _kda_fwd(FEW_SEQUENCE_HEADS, warps),  # many sequence-heads
    "kda_fwd_few_heads": lambda warps: _kda_fwd(1, warps),
    "kda_bwd": lambda _warps: _kda_bwd(),
    "moe_gate_up": lambda _warps: _moe_gate_up(),
    "moe_down": lambda _warps: _moe_down(),
    "moe_gate_up_small_groups": lambda _warps: _moe_gate_up(MOE_SMALL_GROUP_EXPERTS),
    "moe_down_small_groups": lambda _warps: _moe_down(MOE_SMALL_GROUP_EXPERTS),
    "moe_weight_grads": lambda _warps: _moe_weight_grads(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", metavar="case",
                        help=f"any of {', '.join(CASES)} (default: all)")
    parser.add_argument("--warps", type=int, help="num_warps for the cases whose public function "
                        "takes it (kda_fwd, kda_fwd_few_heads: the inter stage's); the others keep their own")
    opts = parser.parse_args()
    unknown = sorted(set(opts.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    header = (f"{'case':<24} {'kernel':<28} {'warps':>5} {'regs':>5} {'spill st':>9} {'spill ld':>9} "
              f"{'smem':>7}")
    print(header)
    print("-" * len(header))
    for case in opts.cases or CASES:
        fn, args = CASES[case](opts.warps)
        for kernel in triton_kernels(fn, args):
            u = usage(kernel)
            print(f"{case:<24} {kernel.name:<28} {kernel.num_warps:>5} {u.registers:>5} "
                  f"{u.spill_stores:>9} {u.spill_loads:>9} {u.shared_bytes:>7}", flush=True)


if __name__ == "__main__":
    main()
