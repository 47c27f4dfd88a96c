"""The CPU-reachable parts of benchmarks/swa.py: arguments, pool-capacity arithmetic, shapes."""

from __future__ import annotations

import pytest
from benchmarks import swa
from benchmarks.shapes import config_dir
from tide.model_config import ModelConfig


def test_parse_args_defaults_quick_and_errors():
    full = swa.parse_args([])
    assert full.parts == ("a", "b", "c", "d") and full.shapes == ("gemma-3-12b", "gemma-2-9b")
    assert full.request_len == 8192 and full.contexts == (1024, 8192, 32768)
    assert full.num_requests == 256 and full.decode_bs == 64
    quick = swa.parse_args(["--quick", "--only", "a,c", "--shapes", "gemma-2-9b"])
    assert quick.parts == ("a", "c") and quick.shapes == ("gemma-2-9b",)
    assert quick.request_len == 2048 and quick.num_requests == 64
    for bad in (["--only", "a,x"], ["--shapes", "llama"], ["--swa-ratio", "0"]):
        with pytest.raises(SystemExit):
            swa.parse_args(bad)


def test_capacity_arithmetic():
    # Gemma-3: window 1024, page 64: a request holds 1088 SWA slots.
    assert swa.swa_ratio_for(1024, 8192) == pytest.approx(1.15 * 1088 / 8192)
    assert swa.swa_ratio_for(4096, 2048) == 1.0  # the window is longer than the request
    assert swa.analytic_capacity(81920, None, 8192, 1024) == 10
    assert swa.analytic_capacity(81920, 5440, 8192, 1024) == 5  # the SWA pool binds
    assert swa.kv_bytes_per_step(32768, 8, 40, 1024, 100) == 100 * (8 * 32768 + 40 * 1024)


def test_benchmark_shapes_are_hybrid():
    g3 = ModelConfig.from_dir(config_dir("gemma-3-12b"))
    assert (g3.sliding_window, len(g3.sliding_layer_ids), len(g3.full_layer_ids)) == (1024, 40, 8)
    g2 = ModelConfig.from_dir(config_dir("gemma-2-9b"))
    assert (g2.sliding_window, len(g2.sliding_layer_ids), len(g2.full_layer_ids)) == (4096, 21, 21)
    assert g2.attn_logit_softcapping == 50.0


def test_per_layer_translation_build_gives_the_same_tokens(tmp_path):
    """(c)'s slow build translates in every sliding layer: same outputs, more translations."""
    import tide

    from conftest import random_prompts
    from test_swa_models import build_swa_checkpoint

    path = build_swa_checkpoint(tmp_path / "g2", "gemma2")  # two sliding layers
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    prompt = random_prompts(7, [12])[0]
    counts, outs = [], []
    for per_layer in (False, True):
        with tide.Engine(str(path), max_total_tokens=256) as engine:
            pool = engine.model_runner.token_to_kv_pool
            if per_layer:
                with swa._PerLayerTranslation():
                    outs.append(engine.generate(input_ids=prompt, sampling_params=params))
            else:
                outs.append(engine.generate(input_ids=prompt, sampling_params=params))
            counts.append(pool.num_translations)
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert counts[1] == 3 * counts[0]  # once per forward + once in each of the 2 sliding layers


def test_capacity_measurement_reaches_the_analytic_count(tmp_path):
    """(a)'s measurement on a tiny Gemma-3 (window 8): with more requests than fit, the peak number
    holding KV is the pools' analytic capacity (the full pool binds here), with no retraction."""
    import tide

    from test_swa_models import build_swa_checkpoint

    path = build_swa_checkpoint(tmp_path / "g3", "gemma3")
    request_len = 48
    with tide.Engine(str(path), max_total_tokens=480, swa_full_tokens_ratio=0.4) as engine:
        layout = engine.get_server_info()["kv_cache_layout"]
        cap = swa.analytic_capacity(layout["full_tokens"], layout["swa_tokens"], request_len,
                                    layout["sliding_window"])
        assert cap == 10
        new_tokens = swa._capacity_new_tokens(request_len)
        peak, retractions = swa._peak_running(engine, 13, request_len, new_tokens)
        assert new_tokens == 3 and retractions == 0
        assert peak == cap
        engine.scheduler.check_invariants()
