"""benchmarks/gpu_check.py runs on CPU at tiny shapes, so the GPU script cannot rot between the
sessions that have a GPU: every check passes and every section writes its results."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402 (benchmarks/ on the path first)


def test_gpu_check_runs_on_cpu_at_tiny_shapes(tmp_path):
    report = gpu_check.main(
        ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--repeats", "2", "--requests", "8"]
    )
    checks = report["checks"]
    assert checks["compiled_equals_eager"] is True
    assert checks["int8_kernel_ok"] is True and checks["int4_kernel_ok"] is True
    assert checks["paged_equals_static"] is True
    assert (
        report["sections_done"]
        == ["bandwidth", "correctness", "decode", "engine_graphs", "engine_vs_hf"]
        and "errors" not in report
    )
    assert checks["graphs equal eager at every bucket, both dtypes"] is True
    assert all(v == 1.0 for k, v in checks.items() if k.startswith("float32") and "flex ==" in k)
    (row,) = report["engine_vs_hf"]
    assert row["ours_tok_s"] > 0 and row["hf_continuous_tok_s"] > 0 and row["graphs"]["replays"]
    assert not [r for r in report["decode"] if "skipped" in r]
    timed = [r for r in report["decode"] if "tokens_per_s" in r]
    assert {(r["weights"], r["mode"]) for r in timed} >= {
        ("bf16", "eager"),
        ("bf16", "compiled"),
        ("int8", "compiled"),
        ("int4", "compiled"),
    }
    assert all(r["tokens_per_s"] > 0 and r["gb_s"] > 0 for r in timed)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["sections_done"] == report["sections_done"]
    assert (
        "| llama2-7b (tiny stand-in) | int4 | compiled |" in (tmp_path / "gpu_check.md").read_text()
    )
