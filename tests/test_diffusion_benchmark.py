"""`python -m benchmarks.diffusion --quick` runs on a CPU and writes a complete JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("diffusers")

from server_utils import REPO


def test_quick_benchmark_writes_json(tmp_path):
    out = tmp_path / "quick.json"
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.diffusion", "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["quick"] is True and set(res["results"]) == {"flux", "sdxl"}
    for name, model in res["results"].items():
        assert set(model["batch"]) == {"1", "2"}
        for bs, row in model["batch"].items():
            for system in ("tide", "diffusers"):
                r = row[system]
                assert r["latency_ms"] > 0 and r["images_per_s"] > 0
                assert r["latency_per_image_ms"] == pytest.approx(r["latency_ms"] / int(bs))
                assert {"text_encoding", "denoising", "decoding"} <= set(r["stage_ms"])
            # Same weights, fp32 on the CPU: the two pipelines agree.
            assert row["max_abs_diff"] <= 1e-4, (name, bs, row["max_abs_diff"])
    assert "| tiny-flux 32x32 2 steps | 1 | tide |" in proc.stdout
