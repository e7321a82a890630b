"""The serving benchmark's CPU smoke mode runs end to end and reports every number."""

from __future__ import annotations

import json
import math

from benchmarks.serve_throughput import main


def test_smoke(tmp_path, capsys):
    out = tmp_path / "serve.json"
    results = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (level,) = results["levels"]
    assert level["clients"] == 1 and level["tokens"] == results["new"]
    for key in ("tokens_per_s", "generate_tokens_per_s", "ttft_p50_ms", "itl_p50_ms"):
        assert math.isfinite(level[key]) and level[key] > 0, key
    assert results["second_turn"]["with_prefix_cache_ms"] > 0
    assert results["max_prefill_tokens"] == 8192
    assert results["unrolled"] is False  # --layer-layout auto scans on CPU
    assert "| clients | served tok/s |" in capsys.readouterr().out
