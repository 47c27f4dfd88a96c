"""The Triton attention kernels with sliding windows and soft-capping, on the CPU.

The key ranges the kernels visit (`split_kv`, plain Python) are checked everywhere. Where triton is
installed (CI has none: those tests skip), the kernels themselves run in triton's CPU interpreter
against torch_native's `attend`, with NaN planted in every KV slot no query of the launch may see: a
kernel that read an out-of-window slot, or multiplied a zero weight by such a value, would return NaN.
A load probe counts the key blocks a launch visits and checks them against `split_kv`.

The interpreter must be on before triton is first imported (`TRITON_INTERPRET=1` decides how
`triton.language` itself is built), so `test_kernels_in_the_interpreter` reruns this file in a
subprocess with the flag set; there the interpreter tests run and that test skips. Run them directly
with `TRITON_INTERPRET=1 pytest tests/test_triton_attention.py`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tide.layers.attention import split_kv, torch_native
from tide.layers.attention.layer import Attention

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED),
    reason="runs in triton's CPU interpreter (TRITON_INTERPRET=1), see test_kernels_in_the_interpreter",
)

HEADS, KV_HEADS, DIM = 4, 2, 16
# (sliding_window, logit_cap): full, tiny window (below one key block), a window spanning blocks,
# soft-cap alone and with a window (Gemma-2 shapes).
CASES = [(None, None), (1, None), (8, None), (100, 50.0), (None, 2.0), (8, 2.0)]


# ---- key ranges (no triton needed)


@pytest.mark.parametrize("window", [None, 1, 7, 64, 1000, 4096])
@pytest.mark.parametrize("num_splits", [1, 3, 16, 128])
def test_decode_splits_cover_exactly_the_visible_keys(window, num_splits):
    for seq_len in (1, 2, 63, 64, 65, 1000, 4096, 4097, 70_000):
        bounds = split_kv.decode_split_bounds(seq_len, window, num_splits)
        first = 0 if window is None else max(seq_len - window, 0)
        assert bounds[0][0] == first and bounds[-1][1] == seq_len
        assert all(s < e for s, e in bounds)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order
        assert len(bounds) <= num_splits
        # Splits are sized by the visible length: equal (the last may be short), at least
        # MIN_SPLIT_LEN unless fewer keys are visible.
        per = bounds[0][1] - bounds[0][0]
        assert all(e - s == per for s, e in bounds[:-1])
        assert per >= min(split_kv.MIN_SPLIT_LEN, seq_len - first)


def test_sliding_decode_cost_does_not_grow_with_context():
    """A sliding layer's decode step visits min(seq_len, window) keys in a bounded number of blocks
    at any context length; a full layer's grows with the context."""
    window, splits = 1024, 128
    bound = -(-window // split_kv.DECODE_BLOCK_N) + splits
    for seq_len in (window, window + 1, 8192, 32_768, 1_000_000):
        keys = sum(e - s for s, e in split_kv.decode_split_bounds(seq_len, window, splits))
        assert keys == window
        assert split_kv.decode_blocks_visited(seq_len, window, splits, 128) <= bound
    assert split_kv.decode_blocks_visited(1_000_000, window, splits, 128) == (
        split_kv.decode_blocks_visited(8192, window, splits, 128))
    assert split_kv.decode_blocks_visited(1_000_000, None, splits, 128) > 100 * bound


def test_decode_values_as_words_only_where_measured():
    """fp8 K/V with few splits read their values as int16 words (measured faster at head dim 256
    in 64-key blocks, and at head dim 128 with a 5-stage pipeline); with many splits (32-key
    blocks, unmeasured) and for 2- and 4-byte caches they read them as they are."""
    wide = split_kv.decode_block_config(1, 256, kv_bytes=1)
    assert wide.v_pairs and (wide.block_n, wide.stages) == (64, 2)
    for splits, dim in ((1, 128), (2, 64), (4, 128)):
        deep = split_kv.decode_block_config(splits, dim, 1)
        assert deep.v_pairs and (deep.block_n, deep.stages) == (128, 5)
    for splits, dim, kv_bytes in ((16, 128, 1), (16, 256, 1), (1, 256, 2), (1, 128, 2), (1, 128, 4)):
        assert not split_kv.decode_block_config(splits, dim, kv_bytes).v_pairs
    # Up to 16 query heads a kv head (one 16-row tile, as measured); a taller tile reads bytes.
    assert split_kv.decode_block_config(1, 128, 1, group=16).v_pairs
    assert not split_kv.decode_block_config(1, 128, 1, group=32).v_pairs


def test_fp8_decode_fits_the_device_shared_memory():
    """fp8 words through 5 stages need ~108 KB of shared memory a program: a device that opts in to
    less (sm_89, sm_120: ~99 KB) reads bytes through 3 stages (41 KB), an sm_90 keeps words."""
    assert split_kv.decode_block_config(1, 128, 1, shared_bytes=227 * 1024).v_pairs
    small = split_kv.decode_block_config(1, 128, 1, shared_bytes=99 * 1024)
    assert not small.v_pairs and small.stages == 3
    # Head dim 256's words in 64-key blocks take ~76 KB and stay.
    assert split_kv.decode_block_config(1, 256, 1, shared_bytes=99 * 1024).v_pairs


def test_decode_prefetch_only_where_measured():
    """The first key block loads before the PDL wait only above head dim 128, for 2-byte caches
    (measured faster in bf16, slower with fp8), in blocks of at most PREFETCH_MAX_BLOCK_BYTES."""
    assert split_kv.decode_prefetch(256, 32, 2)
    assert not split_kv.decode_prefetch(128, 32, 2)
    assert not split_kv.decode_prefetch(256, 64, 2)  # 32 KB held across the wait
    assert not split_kv.decode_prefetch(256, 32, 1) and not split_kv.decode_prefetch(256, 64, 1)
    assert not split_kv.decode_prefetch(256, 32, 4)


def test_decode_batch_fits_the_grid_axis():
    """Decode stage 1 puts the batch on grid axis 1 (at most 65535 programs): a larger
    `max_running_requests` is refused by name when the engine is configured."""
    from tide.config import DEMO_MODEL_PATH, MAX_RUNNING_REQUESTS, EngineConfig

    assert EngineConfig(model_path=DEMO_MODEL_PATH,
                        max_running_requests=MAX_RUNNING_REQUESTS).max_running_requests == 65535
    with pytest.raises(ValueError, match="max_running_requests must be at most 65535"):
        EngineConfig(model_path=DEMO_MODEL_PATH, max_running_requests=MAX_RUNNING_REQUESTS + 1)


@pytest.mark.parametrize("block", [64, 128])
def test_extend_reads_only_keys_some_query_of_the_block_sees(block):
    for window in (None, 1, 8, 100, 5000):
        for prefix, n in ((0, 1), (0, 200), (37, 5), (1000, 130), (5000, 64)):
            bounds = split_kv.extend_kv_bounds(prefix, n, window, block)
            assert len(bounds) == -(-n // block)
            for i, (start, end) in enumerate(bounds):
                q_first, q_last = prefix + i * block, prefix + min((i + 1) * block, n) - 1
                assert end == q_last + 1
                assert start == (0 if window is None else max(q_first - window + 1, 0))
                if window is not None:  # O(window) keys per block of queries
                    assert end - start <= block + window - 1


def test_auto_backend_runs_windowed_models_on_triton_on_cuda():
    """The triton backend implements windows and soft-caps, so `auto` gives it windowed and
    soft-capped models on CUDA and naming it is accepted (torch_native stays the CPU choice)."""
    from tide.layers.attention import select_attention_backend
    from tide.layers.attention.torch_native import TorchNativeAttnBackend
    from tide.layers.attention.triton_backend import TritonAttnBackend
    from tide.model_config import ModelConfig

    from test_swa_config import GEMMA2_9B, GEMMA3_12B

    for hf in (GEMMA2_9B, GEMMA3_12B):
        mc = ModelConfig.from_hf_dict(hf)
        assert mc.has_sliding_layers
        assert select_attention_backend("auto", "cuda", mc) is TritonAttnBackend
        assert select_attention_backend("triton", "cuda", mc) is TritonAttnBackend
        assert select_attention_backend("auto", "cpu", mc) is TorchNativeAttnBackend


# ---- the kernels in triton's interpreter


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton; runs the tests below")
def test_kernels_in_the_interpreter():
    """The interpreter tests of this file, in a subprocess with TRITON_INTERPRET=1: all pass, none
    skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpreted"],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and "deselected" in summary, tail
    # decode per case, extend per case in three tilings, the two visit counts, two models, fp8
    # values as words (2), extend in fp16 (2), extend's diagonal-block count (2)
    expected = len(CASES) + 3 * len(CASES) + 3 + 2 + 2 + 2 + 2
    assert int(summary.split(" passed")[0].split()[-1]) == expected, tail


@pytest.fixture(scope="module")
def kernels():
    from tide.layers.attention import triton_kernels

    return triton_kernels


class _Pool:
    """A shuffled KV pool: request i's token at position p lives in slot table[i, p]."""

    def __init__(self, lens: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        total = sum(lens)
        self.k = torch.randn(total + 8, KV_HEADS, DIM, generator=gen)
        self.v = torch.randn(total + 8, KV_HEADS, DIM, generator=gen)
        perm = torch.randperm(total, generator=gen) + 4  # slots 0..3 and the tail stay unused
        self.table = torch.zeros(len(lens), max(lens) + 5, dtype=torch.int32)
        off = 0
        for i, n in enumerate(lens):
            self.table[i, :n] = perm[off : off + n].to(torch.int32)
            off += n
        self.visible: set[int] = set()

    def see(self, req: int, lo: int, hi: int) -> None:
        """Mark positions lo..hi-1 of request `req` as visible to some query of the launch."""
        self.visible.update(self.table[req, lo:hi].tolist())

    def poison_the_rest(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool copies with NaN in every slot no query may see."""
        hidden = torch.ones(self.k.shape[0], dtype=torch.bool)
        hidden[sorted(self.visible)] = False
        k, v = self.k.clone(), self.v.clone()
        k[hidden] = float("nan")
        v[hidden] = float("nan")
        return k, v


def _layer(window, cap) -> Attention:
    return Attention(HEADS, KV_HEADS, DIM, DIM**-0.5, 0, sliding_window=window, logit_cap=cap)


def _decode(kernels, pool, q, lens, layer, splits, k, v, prefetch=None):
    out = torch.empty_like(q)
    bs = q.shape[0]
    mid_o = torch.empty(bs, HEADS, splits, DIM)
    mid_lse = torch.empty(bs, HEADS, splits)
    kernels.decode_attention(q, k, v, out, pool.table, torch.arange(bs), torch.tensor(lens), mid_o,
                             mid_lse, layer.scaling, layer.sliding_window, layer.logit_cap,
                             prefetch=prefetch)
    return out


@needs_triton
@pytest.mark.parametrize("window,cap", CASES)
def test_interpreted_decode_matches_torch_native(kernels, monkeypatch, window, cap):
    """Sequences shorter than, at, just past and far past the window; 1 to 16 splits; stage 2
    merging the whole head in one program and in column slices; stage 1 with every key block in its
    loop and with the first block loaded apart (`prefetch`, the GPU's path above head dim 128: the
    newest key left out of it and, where the first block holds it, the block loaded again; 32, 96
    and 128 put the newest key in the last slot of a split's first block)."""
    lens = [1, 5, 8, 9, 32, 96, 128, 130, 700]
    pool = _Pool(lens, seed=len(CASES) + (window or 0))
    layer = _layer(window, cap)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    ref = []
    for i, n in enumerate(lens):
        kv0 = split_kv.decode_visible_start(n, window)
        pool.see(i, kv0, n)
        slots = pool.table[i, kv0:n].long()
        ref.append(torch_native.attend(q[i : i + 1], pool.k[slots], pool.v[slots], n - 1, kv0, layer))
    ref = torch.cat(ref)
    k, v = pool.poison_the_rest()
    for splits, columns, prefetch in ((1, DIM, False), (2, DIM, False), (16, DIM, False),
                                      (16, DIM // 2, False), (1, DIM, True), (16, DIM, True)):
        monkeypatch.setattr(kernels, "STAGE2_COLUMNS", columns)
        out = _decode(kernels, pool, q, lens, layer, splits, k, v, prefetch)
        assert not out.isnan().any(), f"splits {splits}: a hidden slot was read"
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    if window is not None:  # the window is exact: one more key changes the result
        wider = [torch_native.attend(q[i : i + 1], pool.k[pool.table[i, : n].long()],
                                     pool.v[pool.table[i, : n].long()], n - 1, 0, _layer(window + 1, cap))
                 for i, n in enumerate(lens)]
        assert (torch.cat(wider) - ref)[-1].abs().max() > 1e-3


@needs_triton
@pytest.mark.parametrize("window", [None, 8])
def test_interpreted_fp8_decode_values_as_words_equal_bytes(kernels, monkeypatch, window):
    """An fp8 pool's values read as int16 words and widened (`DecodeBlocks.v_pairs`; the
    interpreter's shift-and-mask widening, the GPU's runs one PTX conversion a word) give exactly
    the output of reading them as bytes, with and without the first-block prefetch and over 1 and
    16 splits, and match attention over the widened pool. Hidden slots hold fp8 NaN."""
    lens = [1, 5, 8, 9, 32, 96, 128, 130, 700]
    pool = _Pool(lens, seed=3)
    layer = _layer(window, None)
    for i, n in enumerate(lens):
        pool.see(i, split_kv.decode_visible_start(n, window), n)
    k, v = (t.to(torch.float8_e4m3fn) for t in pool.poison_the_rest())
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    ref = []
    for i, n in enumerate(lens):
        kv0 = split_kv.decode_visible_start(n, window)
        slots = pool.table[i, kv0:n].long()
        ref.append(torch_native.attend(q[i : i + 1], k[slots].float(), v[slots].float(), n - 1,
                                       kv0, layer))
    ref = torch.cat(ref)
    base = split_kv.decode_block_config
    stage1 = kernels._decode_stage1
    launched: list[tuple[bool, torch.dtype]] = []

    class Recorder:  # the launch's V_PAIRS and the dtype of the V it passes
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["V_PAIRS"], args[2].dtype))
                return stage1[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kernels, "_decode_stage1", Recorder())
    for splits, prefetch in ((1, False), (16, False), (1, True)):
        outs = []
        for pairs in (False, True):
            monkeypatch.setattr(kernels, "decode_block_config",
                                lambda *a, p=pairs, **kw: base(*a, **kw)._replace(v_pairs=p))
            outs.append(_decode(kernels, pool, q, lens, layer, splits, k, v, prefetch))
            assert launched[-1] == ((True, torch.int16) if pairs else (False, torch.float8_e4m3fn))
        assert not outs[1].isnan().any(), f"splits {splits}: a hidden slot was read"
        assert torch.equal(outs[0], outs[1]), f"splits {splits}, prefetch {prefetch}"
        # The query and the weights round to fp16 for the dots.
        torch.testing.assert_close(outs[1], ref, atol=2e-2, rtol=2e-2)


def test_extend_tiles_by_head_dim_and_cache():
    """2-byte caches take tall tiles (measured faster there): 128 rows against 32-key blocks at
    head dims up to 128, against 64-key blocks on 8 warps at 256 where the device has the shared
    memory (not on ~99 KB or ~163 KB devices); fp8 caches take 128 x 128 on 8 warps at head dims
    up to 128 where 96 KB fit; fp32, and fp8 at 256, keep 64 x 64."""
    tall, square = split_kv.ExtendBlocks(128, 32, 4, 3), split_kv.ExtendBlocks(64, 64, 4, 2)
    fp8_tall = split_kv.ExtendBlocks(128, 128, 8, 2)
    for head_dim in (64, 96, 128):
        assert split_kv.extend_block_config(head_dim, 2) == tall
        assert split_kv.extend_block_config(head_dim, 2, 99 * 1024) == tall  # 65,792 bytes
        assert split_kv.extend_block_config(head_dim, 1) == fp8_tall
        assert split_kv.extend_block_config(head_dim, 1, 99 * 1024) == fp8_tall  # 98,304 bytes
        assert split_kv.extend_block_config(head_dim, 1, 64 * 1024) == square
        assert split_kv.extend_block_config(head_dim, 4) == square
    wide = split_kv.ExtendBlocks(128, 64, 8, 2)
    assert split_kv.extend_block_config(256, 2) == wide
    assert split_kv.extend_block_config(256, 2, 227 * 1024) == wide
    assert split_kv.extend_block_config(256, 2, 163 * 1024) == square
    assert split_kv.extend_block_config(256, 1) == square
    assert split_kv.extend_block_config(256, 4) == square


@needs_triton
@pytest.mark.parametrize("tiles", [None, (128, 32, 4, 3), (32, 16, 4, 2)])
@pytest.mark.parametrize("window,cap", CASES)
def test_interpreted_extend_with_prefix_and_chunks_matches_torch_native(kernels, window, cap, tiles,
                                                                        monkeypatch):
    """Each request's prompt arrives in chunks (chunked prefill, or new tokens on a cached prefix);
    every chunk's attention over prefix + itself equals the reference, with the default tiles of
    the fp32 test pool and with tiles whose diagonal blocks start off the key-block grid."""
    if tiles is not None:
        fixed = split_kv.ExtendBlocks(*tiles)
        monkeypatch.setattr(kernels, "extend_block_config", lambda *a, **kw: fixed)
    chunks = [[9], [3, 30], [20, 70, 5], [130, 1], [64, 64, 65]]
    lens = [sum(c) for c in chunks]
    pool = _Pool(lens, seed=100 + (window or 0))
    layer = _layer(window, cap)
    gen = torch.Generator().manual_seed(2)
    for step in range(max(len(c) for c in chunks)):
        reqs = [i for i, c in enumerate(chunks) if step < len(c)]
        prefix = [sum(chunks[i][:step]) for i in reqs]
        ext = [chunks[i][step] for i in reqs]
        starts = [sum(ext[:j]) for j in range(len(ext))]
        q = torch.randn(sum(ext), HEADS, DIM, generator=gen)
        ref = torch.empty_like(q)
        pool.visible.clear()
        for j, i in enumerate(reqs):
            for r in range(ext[j]):
                pos = prefix[j] + r
                kv0 = 0 if window is None else max(pos - window + 1, 0)
                pool.see(i, kv0, pos + 1)
                slots = pool.table[i, kv0 : pos + 1].long()
                row = starts[j] + r
                ref[row] = torch_native.attend(q[row : row + 1], pool.k[slots], pool.v[slots], pos, kv0,
                                               layer)[0]
        k, v = pool.poison_the_rest()
        out = torch.empty_like(q)
        kernels.extend_attention(q, k, v, out, pool.table, torch.tensor(reqs), torch.tensor(prefix),
                                 torch.tensor(ext), torch.tensor(starts), max(ext), layer.scaling,
                                 window, cap)
        assert not out.isnan().any(), f"chunk {step}: a hidden slot was read"
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("window,cap", [(None, None), (8, 2.0)])
def test_interpreted_extend_in_fp16_takes_the_tall_tiles(kernels, window, cap, monkeypatch):
    """A 2-byte cache runs the default tall tiles (128 rows, 32-key blocks) through base-2 scores:
    chunks on cached prefixes equal fp32 attention over the same fp16 values."""
    launched = []
    real = kernels.extend_block_config

    def spy(*a, **kw):
        launched.append(real(*a, **kw))
        return launched[-1]

    monkeypatch.setattr(kernels, "extend_block_config", spy)
    lens, prefix = [200, 90], [37, 0]
    pool = _Pool(lens, seed=11)
    layer = _layer(window, cap)
    ext = [n - p for n, p in zip(lens, prefix)]
    starts = [0, ext[0]]
    q = torch.randn(sum(ext), HEADS, DIM, generator=torch.Generator().manual_seed(3)).half()
    k, v = pool.k.half(), pool.v.half()
    ref = torch.empty(q.shape)
    for j in range(2):
        for r in range(ext[j]):
            pos = prefix[j] + r
            kv0 = 0 if window is None else max(pos - window + 1, 0)
            slots = pool.table[j, kv0 : pos + 1].long()
            row = starts[j] + r
            ref[row] = torch_native.attend(q[row : row + 1].float(), k[slots].float(), v[slots].float(),
                                           pos, kv0, layer)[0]
    out = torch.empty_like(q)
    kernels.extend_attention(q, k, v, out, pool.table, torch.tensor([0, 1]), torch.tensor(prefix),
                             torch.tensor(ext), torch.tensor(starts), max(ext), layer.scaling, window, cap)
    assert launched == [split_kv.ExtendBlocks(128, 32, 4, 3)]
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


class _LoadProbe:
    """Records which rows of `buffer` each load of an interpreted kernel reads (unmasked lanes)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.base = buffer.data_ptr()
        self.end = self.base + buffer.numel() * buffer.element_size()
        self.row_bytes = buffer.stride(0) * buffer.element_size()
        self.loads: list[set[int]] = []

    def install(self, monkeypatch) -> None:
        from triton.runtime import interpreter

        real = interpreter.InterpreterBuilder.create_masked_load
        probe = self

        def load(builder, ptrs, mask, other, *flags):  # cache / eviction / volatile flags vary
            addrs = ptrs.data[mask.data.astype(bool)].astype("int64")
            hit = addrs[(addrs >= probe.base) & (addrs < probe.end)]
            if hit.size:
                probe.loads.append({int(a) for a in (hit - probe.base) // probe.row_bytes})
            return real(builder, ptrs, mask, other, *flags)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)


@needs_triton
@pytest.mark.parametrize("window", [None, 48])
def test_interpreted_decode_visits_only_the_window(kernels, monkeypatch, window):
    """Counted in the interpreter: a decode step over 2,000 tokens with a 48-token window loads the
    keys of exactly the visible slots, in the number of blocks `split_kv` predicts, per kv head."""
    lens = [2000, 30]
    pool = _Pool(lens, seed=5)
    layer = _layer(window, None)
    q = torch.randn(2, HEADS, DIM)
    probe = _LoadProbe(pool.k)
    probe.install(monkeypatch)
    splits = 4
    out = _decode(kernels, pool, q, lens, layer, splits, pool.k, pool.v)
    assert out.isfinite().all()
    visible = set()
    for i, n in enumerate(lens):
        visible.update(pool.table[i, split_kv.decode_visible_start(n, window) : n].tolist())
    assert set().union(*probe.loads) == visible
    expected = KV_HEADS * sum(split_kv.decode_blocks_visited(n, window, splits, DIM, pool.k.element_size())
                             for n in lens)
    assert len(probe.loads) == expected
    if window is not None:
        assert expected <= KV_HEADS * 2 * (-(-window // split_kv.DECODE_BLOCK_N) + splits)


@needs_triton
def test_interpreted_extend_visits_only_the_window(kernels, monkeypatch):
    window = 40
    n = 300
    pool = _Pool([n], seed=6)
    probe = _LoadProbe(pool.k)
    probe.install(monkeypatch)
    q = torch.randn(n, HEADS, DIM)
    out = torch.empty_like(q)
    kernels.extend_attention(q, pool.k, pool.v, out, pool.table, torch.tensor([0]), torch.tensor([0]),
                             torch.tensor([n]), torch.tensor([0]), n, DIM**-0.5, window, None)
    tiles = split_kv.extend_block_config(DIM, pool.k.element_size())
    blocks = sum(-(-(e - s) // tiles.block_n)
                 for s, e in split_kv.extend_kv_bounds(0, n, window, tiles.block_m))
    assert len(probe.loads) == HEADS * blocks
    full = sum(-(-(e - s) // tiles.block_n)
               for s, e in split_kv.extend_kv_bounds(0, n, None, tiles.block_m))
    assert blocks < full


@needs_triton
@pytest.mark.parametrize("tiles", [(64, 64, 4, 2), (32, 16, 4, 2)])
def test_interpreted_extend_masks_only_diagonal_blocks_and_reads_visible_keys(kernels, monkeypatch,
                                                                           tiles):
    """Without a window, each block of new tokens reads the prefix keys before its first token in
    one loop (no causal mask) and its diagonal in a second: `ceil(d / n) + ceil((end - d) / n)`
    key blocks for d = the block's first position, n keys a block, off the key-block grid too
    (a 37-token prefix); every key read is one some query of the block sees."""
    fixed = split_kv.ExtendBlocks(*tiles)
    monkeypatch.setattr(kernels, "extend_block_config", lambda *a, **kw: fixed)
    prefix, n = 37, 150
    pool = _Pool([prefix + n], seed=7)
    probe = _LoadProbe(pool.k)
    probe.install(monkeypatch)
    q = torch.randn(n, HEADS, DIM)
    out = torch.empty_like(q)
    kernels.extend_attention(q, pool.k, pool.v, out, pool.table, torch.tensor([0]),
                             torch.tensor([prefix]), torch.tensor([n]), torch.tensor([0]), n, DIM**-0.5)
    expected = 0
    for m0 in range(0, n, fixed.block_m):
        diag, end = prefix + m0, prefix + min(m0 + fixed.block_m, n)
        expected += -(-diag // fixed.block_n) + -(-(end - diag) // fixed.block_n)
    assert len(probe.loads) == HEADS * expected
    assert set().union(*probe.loads) == set(pool.table[0, : prefix + n].tolist())
    assert out.isfinite().all()


# ---- whole models through the triton backend in the interpreter (a subprocess with the flag set)


@needs_triton
@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_interpreted_models_on_the_triton_backend_match_torch_native(arch, tmp_path, monkeypatch):
    """Gemma-2 (alternating window 8 / full layers, soft-caps) and Mistral (window 8 on every layer,
    RoPE fused into the KV store) on the triton backend: prompts across the window in chunks of
    16 tokens, a prefix-cache hit on a windowed prefix, decode past the window. Same greedy tokens
    and logprobs within 1e-5 as torch_native (fp32)."""
    import tide
    from tide.layers.attention import triton_kernels

    from conftest import random_prompts
    from test_swa_models import build_swa_checkpoint

    path = build_swa_checkpoint(tmp_path / arch, arch)
    prompts = random_prompts(900, [9, 37])
    tail = random_prompts(901, [6])[0]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    # Few splits keep the interpreter quick (the kernel tests above cover up to 16).
    monkeypatch.setattr(triton_kernels, "num_kv_splits",
                        lambda rows, most: split_kv.num_kv_splits(rows, min(most, 4)))
    engine = tide.Engine(str(path), device="cpu", attention_backend="triton", chunked_prefill_size=16,
                         max_prefill_tokens=16)
    try:
        assert type(engine.model_runner.attn_backend).__name__ == "TritonAttnBackend"
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        # A follow-up turn: shares the 37-token prompt and its 10 generated tokens (with two KV
        # pools the end of a finished sequence keeps its window, so all of it is a hit).
        follow = prompts[1] + outs[1]["output_ids"] + tail
        again = engine.generate(input_ids=follow, sampling_params=params, return_logprob=True)
    finally:
        engine.shutdown()
    assert again["meta_info"]["cached_tokens"] >= len(prompts[1]) + 10 - 1

    engine = tide.Engine(str(path), device="cpu", attention_backend="torch_native",
                         chunked_prefill_size=16, max_prefill_tokens=16)
    try:
        ref = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        ref_again = engine.generate(input_ids=follow, sampling_params=params, return_logprob=True)
    finally:
        engine.shutdown()
    for got, want in zip(outs + [again], ref + [ref_again]):
        assert got["output_ids"] == want["output_ids"]
        a = torch.tensor([lp for lp, _ in got["meta_info"]["output_token_logprobs"]])
        b = torch.tensor([lp for lp, _ in want["meta_info"]["output_token_logprobs"]])
        assert (a - b).abs().max().item() <= 1e-5
