"""Peak host memory of a conversion is bounded by its largest item, not by the model size.

A random release of ~255 MiB (converted with --experts bf16, the path that decodes; 80 MiB as MXFP4
on disk) with items of at most ~50 MiB is converted in a subprocess. Its peak RSS must stay under the
peak of a `--plan-only` run (same imports, config and headers, no data) plus three times the largest
item: the item being written, the next one being read ahead, and slack for allocator reuse (Orbax's
own staging copy is skipped, see `store._Unstaged`). Holding the whole model would exceed it.
"""

from __future__ import annotations

import json
import subprocess
import sys

from k3jax.checkpoint.release_writer import write_release
from k3jax.checkpoint.store import COMPLETE, MANIFEST
from k3jax.convert import plan_conversion
from tests.k3jax.convert.conftest import golden_config, k3jax_command, subprocess_env

# Linux keeps a child's pre-exec high-water mark in ru_maxrss, and a child forked from this test
# process starts with its RSS; so a small launcher forks the command and reports its wait4 usage.
_LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _peak_rss_bytes(*args) -> int:
    """ru_maxrss (KiB on Linux) of exactly one run of the command."""
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *k3jax_command(*args)], env=subprocess_env(),
                          capture_output=True, text=True, check=True, timeout=300)
    returncode, max_rss_kib = map(int, done.stdout.split())
    assert returncode == 0, done.stderr
    return max_rss_kib * 1024


def test_peak_rss_is_about_one_layer(tmp_path, golden_dir):
    config = golden_config(golden_dir, hidden_size=256, vocab_size=4096, num_hidden_layers=6, num_experts=64,
                           moe_intermediate_size=512, routed_expert_hidden_size=256)
    config["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 5], full_attn_layers=[4, 6])
    source = write_release(tmp_path / "hf", config)
    plan = plan_conversion(source, experts="bf16").plan
    largest = max(item.nbytes for item in plan.items)
    assert plan.nbytes > 4 * largest and plan.nbytes > 200 * 2**20

    baseline = _peak_rss_bytes("convert", source, "--plan-only", "--experts", "bf16")
    peak = _peak_rss_bytes("convert", source, tmp_path / "out", "--quiet", "--experts", "bf16")
    assert (tmp_path / "out" / COMPLETE).is_file()
    assert len(json.loads((tmp_path / "out" / MANIFEST).read_text())["items"]) == len(plan.items)
    assert peak <= baseline + 3 * largest, (
        f"peak RSS {peak / 2**20:.0f} MiB > baseline {baseline / 2**20:.0f} MiB + 3 x largest item "
        f"{largest / 2**20:.0f} MiB (model {plan.nbytes / 2**20:.0f} MiB)"
    )
