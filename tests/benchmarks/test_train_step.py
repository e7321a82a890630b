"""benchmarks/train_step.py --smoke runs on CPU (tiny config, XLA kernels) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.trace import kernels_share

ROOT = Path(__file__).resolve().parents[2]


def test_train_step_smoke(tmp_path):
    out = tmp_path / "train_step.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "benchmarks/train_step.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["matmul_tflops"] > 0
    assert [(r["mode"], r["experts_storage"]) for r in result["runs"]] == [("lora", "mxfp4"), ("full", "bf16")]
    for r in result["runs"]:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["active_params"] > 0
        # The smoke runs use the XLA implementations: a traced step with ops, none of them a Pallas kernel.
        assert r["top_ops"] and r["kernels_share"] == 0
    lora, full = result["runs"]
    assert lora["frozen_active_params"] == lora["active_params"]  # LoRA: every base weight frozen
    assert 0 < full["frozen_active_params"] < full["active_params"]  # the full step's frozen LM head
    assert "| lora (mxfp4 experts) |" in proc.stdout


def test_kernels_share_counts_only_the_pallas_kernels():
    ops = [{"op": "kda_intra_pairs", "share": 0.25}, {"op": "k3_moe_gate_up_situ", "share": 0.5},
           {"op": "gemm_fusion_dot_3", "share": 0.2}, {"op": "memcpy", "share": 0.05}]
    assert kernels_share(ops) == 0.75
