"""Block sizes and key ranges of the Triton attention kernels, in plain Python (no triton import).

The kernels in `triton_kernels` do this arithmetic on the device; these functions compute the same
ranges on the host, so tests and cost estimates can check which keys a launch visits (a sliding
layer's decode step visits min(seq_len, window) keys at any context length) without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

# Shortest split of split-KV decode: short visible ranges use fewer, longer splits.
MIN_SPLIT_LEN = 64
# Head-dim columns per stage-2 program: the merge of up to 128 splits holds 128 x 64 fp32 values
# in registers (the whole head at dim 256 would spill).
STAGE2_COLUMNS = 64
# Decode loads a split's first key block before its PDL wait only above this head dim. The block held
# across the wait takes registers: at head dim 128 (64 -> 78 a thread) a quarter fewer programs fit
# an SM, and on an H100 the kernel measured 14% slower at 32k context and 5% at batch 64 (faster at
# 1k); at head dim 256 the same number fit and it was faster everywhere (1k 11.3 -> 9.0 us per layer,
# 32k 100 -> 98; benchmarks/RESULTS.md).
PREFETCH_MAX_SMALL_HEAD_DIM = 128
# ... and only for key blocks of at most this many bytes (32 keys at head dim 256 in bf16, as
# measured), of 2-byte caches: with an fp8 cache at head dim 256 (one H100, PDL on), the prefetch
# made stage 1 slower at every batch: 256 requests 373 -> 462 us, 64 requests 117 -> 147, 8
# requests (16 splits of 32-key blocks) 23 -> 28.
PREFETCH_MAX_BLOCK_BYTES = 32 * 256 * 2


def decode_prefetch(head_dim: int, block_n: int, kv_bytes: int) -> bool:
    """Whether decode stage 1 loads a split's first key block before its PDL wait (with PDL on):
    above PREFETCH_MAX_SMALL_HEAD_DIM, for 2-byte caches, in blocks of at most
    PREFETCH_MAX_BLOCK_BYTES."""
    return (head_dim > PREFETCH_MAX_SMALL_HEAD_DIM and kv_bytes == 2
            and block_n * head_dim * kv_bytes <= PREFETCH_MAX_BLOCK_BYTES)


# Tokens per stage-1 iteration. With up to 128 splits this measured best at 8k and 32k context on an
# H200 (40 vs 50 us per layer at 32k with 64 splits of 64-token blocks; benchmarks/RESULTS.md).
DECODE_BLOCK_N = 32
# Few splits (large batches, each program reading a request's whole context): a deeper pipeline
# keeps more bytes in flight. Measured on an H200 (benchmarks/attn_batch.py, 256 requests of ~830
# tokens): head dim 128 reads at 0.90 of copy bandwidth with 128-token blocks and 3 stages (0.80
# with 32 and 2); head dim 256 at 0.90 with 32-token blocks and 3 stages (0.63 with 64 and 2).
FEW_SPLITS = 4
# Shared memory a program of fp8 stage 1 takes with values as words through 5 stages at head dim
# <= 128 (sm_90, Triton 3.6: 107,520 bytes). Devices that opt in to less per block (sm_89 and
# sm_120 allow ~99 KB) read bytes through 3 stages (41 KB) instead.
FP8_WORDS_DEEP_SHARED = 108 * 1024


class DecodeBlocks(NamedTuple):
    """How stage 1 of split-KV decode walks a split: `block_n` keys per iteration through a
    software pipeline of `stages`, in programs of `warps` warps. `v_pairs`: an fp8 V is read as
    int16 words (two values each) and widened in registers (`triton_kernels._widen_pairs`).

    No config caps registers. A cap of 168 (three 4-warp programs an SM) once helped fp8 bytes
    through 3 stages on an H100 (0.68 -> 0.75 of copy bandwidth); words through 5 stages, which
    replaced them there, fit two programs an SM by shared memory whatever the registers and ran
    faster uncapped (142 registers; 170.3 vs 173.9 us, Qwen3 heads, 256 requests). Bytes through
    3 stages now serve devices with ~100 KB of shared memory, where two programs an SM is the limit
    either way, and tiles taller than 16 query heads, which were never capped."""

    block_n: int
    stages: int
    warps: int = 4
    v_pairs: bool = False


def decode_block_config(num_splits: int, head_dim: int, kv_bytes: int = 2,
                        group: int = 1, shared_bytes: int | None = None) -> DecodeBlocks:
    """Stage 1's blocks of split-KV decode. `kv_bytes`: the KV element size; 4-byte (fp32) K/V keep
    short blocks and 2 stages (the deep pipeline would need ~150 KB of shared memory, more than GPUs
    other than sm80/sm90 have); 1-byte (fp8) K/V with few splits read their values as words
    (`v_pairs`): 64-token blocks at head dim 256, and at head dim <= 128 with up to 16 query heads
    a kv head 128-token blocks through 5 stages. `group`: query heads per kv head (these configs
    were measured with up to 16, one 16-row tile). `shared_bytes`: the device's shared memory a
    block may opt in to (None: enough for every config here)."""
    if num_splits > FEW_SPLITS or kv_bytes > 2:
        return DecodeBlocks(DECODE_BLOCK_N, 2)
    block_d = 1 << max(head_dim - 1, 1).bit_length()
    if kv_bytes == 1 and block_d > 128:
        # fp8 K/V at head dim 256 (same sweep, `--kv-dtype fp8 --v-pairs 0,1`, one H100): values
        # as words, 64-token blocks and 2 stages, 256 requests 371 us (0.78 of copy bandwidth)
        # where bytes took 389 at best and 511 in 128-token blocks; 64 requests 116 vs 152 us.
        # With `_sixteen_bit_operand`: 350 us (0.82).
        return DecodeBlocks(64, 2, v_pairs=True)
    if kv_bytes == 1 and group <= 16:
        # fp8 K/V at head dim <= 128: values as words (`v_pairs`) through a 5-stage pipeline. At 3
        # or 4 stages Triton gives the key/value loads one shared-memory buffer (the request-table
        # load takes a stage), at 5 two. One H100, 256 requests: 192.2 -> 187.8 us (Qwen3 heads),
        # 194.7 -> 187.7 (Llama heads); 64 requests 63.6 -> 62.9; bytes at 5 stages and words at 3
        # gained little or lost (those figures with a 168-register cap). With the widened values
        # behind `_sixteen_bit_operand` and no cap: Qwen3 heads 185.4 -> 170.3 us, Llama heads
        # 186.9 -> 172.2 (the same build's default before and after, one H100).
        if shared_bytes is not None and shared_bytes < FP8_WORDS_DEEP_SHARED:
            return DecodeBlocks(128, 3)
        return DecodeBlocks(128, 5, v_pairs=True)
    return DecodeBlocks(128 if block_d <= 128 else DECODE_BLOCK_N, 3)


class ExtendBlocks(NamedTuple):
    """Tiles of the extend kernel: `block_m` new tokens (query rows) a program, `block_n` keys an
    iteration through a software pipeline of `stages`, in programs of `warps` warps."""

    block_m: int
    block_n: int
    warps: int = 4
    stages: int = 2


# Shared memory a program of extend takes with 128 query rows against 64-key blocks through 2 stages,
# 8 warps, at head dim 256 in bf16 (sm_90, Triton 3.6: 196,608 bytes).
EXTEND_WIDE_TALL_SHARED = 192 * 1024
# ... and with 128 query rows against 128-key blocks of an fp8 cache, 8 warps, 2 stages, at head dim
# 128 (same compiler: 98,304 bytes).
EXTEND_FP8_TALL_SHARED = 96 * 1024


def extend_block_config(head_dim: int, kv_bytes: int = 2,
                        shared_bytes: int | None = None) -> ExtendBlocks:
    """The extend kernel's tiles for a head dim and KV element size; `shared_bytes`: the shared
    memory a block may opt in to on the device (None: enough for every config here). Measured on
    one H100 against 64 x 64 tiles through 2 stages (the extend kernel's tiles before these), this
    kernel (base-2 scores, the causal mask on diagonal blocks only), benchmarks/RESULTS.md:
    - bf16/fp16 at head dim <= 128: 128 query rows against 32-key blocks through 3 stages. Llama
      heads, an 8k-token chunk of prompts in [100, 1024] 419 -> 303 us, one 32k prompt 59.2 ->
      27.4 ms (torch's varlen flash attention in the same run: 312 us, 25.5 ms).
    - bf16/fp16 at head dim 256: 128 rows against 64-key blocks, 8 warps, 2 stages, where the
      device has the shared memory for it. Gemma heads (16/8): the chunk 498 -> 294 us, one 8k
      prompt 2,951 -> 1,586 us (flash 241 us, 1,860 us).
    - fp8 caches at head dim <= 128: 128 x 128 on 8 warps, 2 stages (96 KB of shared memory), where
      the device has it. Llama heads: one 8k prompt 2,045 -> 1,845 us, 4k new tokens on a 4k prefix
      1,516 -> 1,364, one 32k prompt 32.0 -> 28.0 ms; an 8k-token chunk of prompts in [100, 1024]
      286 -> 312 us (9% slower; prefill attention of such chunks is ~2% of the standard workload).
    - 64 x 64 elsewhere: fp8 at head dim 256 (taller tiles not measured), fp32 (a 128-row fp32
      query tile would not fit the registers), and devices without the shared memory."""
    def fits(need: int) -> bool:
        return shared_bytes is None or shared_bytes >= need

    if kv_bytes == 2 and head_dim <= 128:
        return ExtendBlocks(128, 32, 4, 3)
    if kv_bytes == 2 and fits(EXTEND_WIDE_TALL_SHARED):
        return ExtendBlocks(128, 64, 8, 2)
    if kv_bytes == 1 and head_dim <= 128 and fits(EXTEND_FP8_TALL_SHARED):
        return ExtendBlocks(128, 128, 8, 2)
    return ExtendBlocks(64, 64, 4, 2)


def num_kv_splits(parallel_rows: int, max_splits: int) -> int:
    """Splits per (request, kv head): enough programs to fill the GPU when the batch is small."""
    splits = 1
    while splits < max_splits and parallel_rows * splits < 1024:
        splits *= 2
    return splits


def decode_visible_start(seq_len: int, sliding_window: int | None) -> int:
    """Position of the first key the decode query (at position seq_len - 1) sees: it sees
    seq_len - sliding_window .. seq_len - 1 (its own token counts, as in transformers)."""
    return 0 if sliding_window is None else max(seq_len - sliding_window, 0)


def decode_split_len(visible_len: int, num_splits: int) -> int:
    """Keys per split of split-KV decode for `visible_len` visible keys."""
    return max(-(-visible_len // num_splits), MIN_SPLIT_LEN)


def decode_split_bounds(
    seq_len: int, sliding_window: int | None, num_splits: int
) -> list[tuple[int, int]]:
    """[start, end) key positions that each non-empty stage-1 split reads for one decode query at
    position seq_len - 1. Together they cover exactly the visible keys, in order."""
    kv_start = decode_visible_start(seq_len, sliding_window)
    per_split = decode_split_len(seq_len - kv_start, num_splits)
    bounds = []
    for split in range(num_splits):
        start = kv_start + split * per_split
        end = min(start + per_split, seq_len)
        if start < end:
            bounds.append((start, end))
    return bounds


def decode_blocks_visited(seq_len: int, sliding_window: int | None, num_splits: int,
                          head_dim: int, kv_bytes: int = 2) -> int:
    """Stage-1 key blocks (of `decode_block_config`'s size) one decode query visits per kv head."""
    block = decode_block_config(num_splits, head_dim, kv_bytes).block_n
    return sum(-(-(e - s) // block) for s, e in decode_split_bounds(
        seq_len, sliding_window, num_splits))


def extend_kv_bounds(
    prefix_len: int, extend_len: int, sliding_window: int | None, block_m: int
) -> list[tuple[int, int]]:
    """[start, end) key positions the extend kernel reads for each block of `block_m` new tokens
    of one request (queries at positions prefix_len .. prefix_len + extend_len - 1): from the first
    key the block's first query sees to the block's last query. Every key in the range is seen by
    some query of the block."""
    bounds = []
    for m0 in range(0, extend_len, block_m):
        q_first = prefix_len + m0
        start = 0 if sliding_window is None else max(q_first - sliding_window + 1, 0)
        bounds.append((start, prefix_len + min(m0 + block_m, extend_len)))
    return bounds
