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


def test_residency_check_passes_on_its_baselines_and_fails_on_a_slowed_stage(tmp_path, capsys,
                                                                           monkeypatch):
    """`--update` writes per-stage baselines (tiny shapes on the CPU); `--check` with the same
    settings passes, and fails naming the stage when one is slowed on purpose."""
    from benchmarks.diffusion import load_baselines, main

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    baselines = tmp_path / "baselines.json"
    common = ["--baselines", str(baselines)]
    assert main(["--quick", "--models", "flux", "--batch-sizes", "1", "--repeats", "3",
                 "--residency", "resident,offload", "--update", *common]) == 0
    data = load_baselines(str(baselines))
    keys = sorted(data["entries"])
    assert keys == ["tiny-flux/32x32/2steps/bs1/offload", "tiny-flux/32x32/2steps/bs1/resident"]
    stages = data["entries"][keys[0]]["stages"]
    assert set(stages) == {"input_validation", "text_encoding", "timestep_preparation",
                           "latent_preparation", "denoising", "decoding"}
    assert "rel" in stages["decoding"]["rule"] and "abs_ms" in stages["denoising"]["rule"]
    capsys.readouterr()

    assert main(["--check", *common]) == 0  # settings from the file
    assert "--check: every stage within tolerance" in capsys.readouterr().out

    assert main(["--check", "--inject-stage-delay", "denoising=600", *common]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert len(failed) == 2 and all("stage denoising" in line and "slower" in line for line in failed)

    # A run with no baseline entry fails too, saying so.
    assert main(["--check", "--residency", "layerwise", *common]) == 1
    assert "bs1/layerwise: no baseline" in capsys.readouterr().out


def test_tolerance_rules():
    from benchmarks.diffusion import tolerance

    assert tolerance({"abs_ms": 2.0, "abs_frac": 0.03}, 10.0) == 2.0
    assert tolerance({"abs_ms": 2.0, "abs_frac": 0.03}, 5000.0) == 150.0
    assert tolerance({"rel": 0.1, "floor_ms": 10.0}, 50.0) == 10.0
    assert tolerance({"rel": 0.1, "floor_ms": 10.0}, 350.0) == 35.0
