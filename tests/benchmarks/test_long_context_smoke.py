"""The long-context benchmarks run end to end in their --smoke mode (tiny shapes on CPU) and write
their JSON: the MLA prefill comparison, long prompts with chunked prefill, decode against bandwidth."""

from __future__ import annotations

import json
import sys

from benchmarks import decode_bandwidth, long_prompt, mla_prefill


def run(monkeypatch, module, out) -> dict:
    monkeypatch.setattr(sys, "argv", [module.__name__, "--smoke", "--out", str(out)])
    module.main()
    return json.loads(out.read_text())


def test_mla_prefill_smoke(monkeypatch, tmp_path):
    result = run(monkeypatch, mla_prefill, tmp_path / "mla.json")
    assert len(result["cases"]) == 2
    for case in result["cases"]:
        for name, r in case["runs"].items():
            assert "ms" in r, f"{name}: {r}"
            assert r["rel_rms_vs_blockwise"] <= 2e-2, name  # bf16 outputs of the same attention


def test_long_prompt_smoke(monkeypatch, tmp_path):
    result = run(monkeypatch, long_prompt, tmp_path / "long.json")
    assert result["chunked_vs_whole_last_logits_rel_rms"] <= 1e-5  # fp32 tiny model
    assert [r["prompt"] for r in result["runs"]] == [64, 96]
    assert all("error" not in r and r["prefill_tokens_per_s"] > 0 and len(r["generated"]) == 8
               for r in result["runs"])


def test_decode_bandwidth_smoke(monkeypatch, tmp_path):
    result = run(monkeypatch, decode_bandwidth, tmp_path / "db.json")
    assert [(r["layout"], r["batch"]) for r in result["runs"]] == [("scan", 1), ("scan", 4), ("unrolled", 1),
                                                                    ("unrolled", 4)]
    for r in result["runs"]:
        assert r["bytes_read"] > result["non_routed_param_bytes"] and 0 < r["experts_touched"] <= 1
        assert r["step_ms"] > 0 and r["percent_of_limit"] > 0
    for layout in ("scan", "unrolled"):
        ops = result["top_ops"][layout]
        assert ops and all(op["total_us"] >= 0 for op in ops)
