"""One launch each of the bf16 and the MXFP4 Mosaic GPU gate+up kernels (K3's widths, 28 experts x
16384 rows), for Nsight Compute: the profile that shows where the MXFP4 kernel's time goes against
the bf16 kernel's (tensor-core use, issue slots, warp stalls).

    ncu --kernel-name regex:k3_moe_gate_up --launch-count 2 --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \\
        --section SchedulerStats --section Occupancy \\
        python3 benchmarks/ncu_gate_up.py

The script turns off JAX's preallocation, so the profiler's replay saves and restores only the live
buffers, not most of the GPU's memory (a preallocating run crashed under it). The two outputs are
checked against each other afterwards (the release decoder's bf16 weights), so the profiled
launches compute what the benchmarks time.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from benchmarks.moe_mxfp4_mgpu import case
from pallas_kernels.moe.mosaic_gpu import gate_up_situ_mgpu, gate_up_situ_mxfp4_mgpu


def main() -> None:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # read when the GPU client is made
    e, n, k, m = 28, 3072, 3584, 16384
    c = case(e, n, k, [m // e + (i < m % e) for i in range(e)], 0)
    bf16 = jax.block_until_ready(gate_up_situ_mgpu(c["x"], c["w1"], c["w3"], c["gs"]))
    mxfp4 = jax.block_until_ready(
        gate_up_situ_mxfp4_mgpu(c["x_ordered"], c["p1"], c["s1"], c["p3"], c["s3"], c["gs"])
    )
    ref = bf16.astype(jnp.float32)
    rel = float(jnp.max(jnp.abs(mxfp4.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    print(f"mxfp4 vs bf16 kernel: max relative difference {rel:.2e}", flush=True)
    assert rel < 1e-2, rel


if __name__ == "__main__":
    main()
