"""Owns the model, the KV pools and the attention backend; runs one forward per call."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from tide.config import EngineConfig
from tide.executor.cuda_graph_runner import CudaGraphRunner, default_batch_sizes
from tide.executor.forward_batch import ForwardBatch, ForwardMode
from tide.layers.attention import select_attention_backend
from tide.layers.batch_invariant import set_batch_invariant
from tide.layers.sampler import PromptScoring, score_logits
from tide.memory.ledger import MemoryLedger
from tide.memory.observe import available_device_memory
from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from tide.memory.swa import SWAKVPool, SWATokenToKVPoolAllocator, min_swa_tokens, swa_pool_sizes
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.parallel import TpGroup, tp_context
from tide.weights import init_dummy_weights, load_checkpoint

if TYPE_CHECKING:
    from tide.memory.placement import Placement
    from tide.memory.vmm import VmmRegion

logger = logging.getLogger(__name__)

_CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
# Input logprobs go through the output head in pieces of at most this many logits (128 MiB in fp32).
SCORE_PIECE_LOGITS = 1 << 25
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, tp_rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `tp_rank`: on CUDA, the `tp_rank`-th GPU from the
    configured one (cuda:N, or the current device)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for but CUDA is not available")
        first = torch.cuda.current_device() if device.index is None else device.index
        if first + tp_rank >= torch.cuda.device_count():
            raise ValueError(f"tp_size needs GPUs {first}..{first + tp_rank} but only "
                             f"{torch.cuda.device_count()} are visible")
        device = torch.device("cuda", first + tp_rank)
    return device


def _owned_tensors(owners: list[object]) -> list[torch.Tensor]:
    """The tensors held by the owners' attributes, directly or in a list, tuple or dict (one level:
    nested objects are listed as owners themselves)."""
    out: list[torch.Tensor] = []
    for owner in owners:
        if owner is None:
            continue
        for value in vars(owner).values():
            if isinstance(value, dict):
                value = list(value.values())
            items = value if isinstance(value, (list, tuple)) else [value]
            out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    dtype = model_config.checkpoint_dtype
    return torch.bfloat16 if dtype == torch.float32 else dtype


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 ledger: MemoryLedger | None, tp: TpGroup | None = None) -> None:
        """`ledger`: where this engine's release points are recorded; `tp`: the tensor-parallel
        group this runner is one rank of (None: one rank, the whole model here)."""
        self.config = config
        self.ledger = ledger
        self.model_config = model_config
        self.tp = tp or TpGroup()
        self.device = resolve_device(config.device, self.tp.rank)
        # This rank's attention heads (KV heads replicated when there are fewer than ranks).
        self.num_heads = model_config.num_attention_heads // self.tp.size
        self.num_kv_heads = self.tp.kv_heads(model_config.num_key_value_heads)[1]
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        # K/V element type: the model dtype, or one byte per value (kv_cache_dtype=fp8_e4m3).
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        self.context_len = config.context_length or model_config.max_position_embeddings
        if self.context_len > model_config.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_len} exceeds the model's max_position_embeddings "
                f"{model_config.max_position_embeddings}"
            )
        if config.quantization == "fp8" and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            if capability < (8, 9):
                raise ValueError("quantization fp8 needs compute capability 8.9 or newer (fp8 "
                                 f"tensor cores); this GPU has {capability}")
            if self.dtype != torch.bfloat16:
                raise ValueError("quantization fp8 on CUDA needs dtype bfloat16 (the fp8 GEMM's "
                                 f"row-wise scales write bf16), got {self.dtype}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.closed = False  # close(): the device memory is given back, nothing runs any more
        # Memory saver on CUDA: weights and KV live in address-stable regions, so release/resume
        # keeps every pointer a captured CUDA graph holds. The weights are made in their region.
        self.use_vmm = False
        self.weights_region: VmmRegion | None = None
        if config.enable_memory_saver and self.device.type == "cuda":
            from tide.memory.vmm import vmm_available

            self.use_vmm = vmm_available()
        try:
            self.model = self._load_model()
            if config.enable_deterministic_inference:
                set_batch_invariant(self.model)
            # The backend first: its own device memory (the deterministic decode's split partials)
            # then counts as used when the KV pools are sized.
            fp8_capability = (torch.cuda.get_device_capability(self.device)
                              if self.device.type == "cuda" and self.kv_dtype == torch.float8_e4m3fn
                              else None)
            backend_cls = select_attention_backend(
                config.attention_backend, self.device.type, model_config, fp8_capability
            )
            self.attn_backend = backend_cls.create(self)
            self._init_pools()
            self.cuda_graph_runner: CudaGraphRunner | None = None
            self.last_greedy_ids: torch.Tensor | None = None
            self._staging: torch.Tensor | None = None
            if self.device.type == "cuda":
                self._staging = torch.empty(4 * 1024, dtype=torch.int64, pin_memory=True)
                self._staging_copied = torch.cuda.Event()
            if (
                self.device.type == "cuda"
                and backend_cls.supports_cuda_graph
                and not config.disable_cuda_graph
            ):
                max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
                self.cuda_graph_runner = CudaGraphRunner(self, default_batch_sizes(max_bs))
        except BaseException:  # e.g. a checkpoint that does not fit, or no room for the KV cache
            self._free_regions()
            raise

    def _free_regions(self) -> None:
        """Free the address-stable regions a failed start has made (the weights', the KV
        cache's), so their memory goes back now; the runner is unusable afterwards."""
        pool = getattr(self, "token_to_kv_pool", None)
        for region in (self.weights_region, getattr(pool, "region", None)):
            if region is not None:
                region.free()
        self.weights_region = None

    def _construct(self) -> torch.nn.Module:
        """The model on the current default device, its weights uninitialised."""
        cls = get_model_class(self.model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with tp_context(self.tp):
                return cls(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)

    def _derive(self, model: torch.nn.Module) -> int:
        """Derived parameters from the loaded weights: with `quantization fp8`, the projections'
        fp8 copies. Returns how many projections run in fp8."""
        if self.config.quantization != "fp8":
            return 0
        from tide.layers import fp8

        return fp8.quantize_model(model)

    def _load_model(self) -> torch.nn.Module:
        with contextlib.ExitStack() as stack:
            placement = stack.enter_context(self._weights_region()) if self.use_vmm else None
            with torch.device(self.device):
                model = self._construct()
            if self.config.load_format == "dummy":
                init_dummy_weights(model, self.config.seed)
            else:
                load_checkpoint(model, self.config.model_path, self.config.show_progress)
            fp8_count = self._derive(model)
            if placement is not None:
                placement.finish(model)
        if placement is not None:
            from tide.memory.placement import buffers_on_host
            from tide.memory.release import empty_device_cache

            # The blocks the parameters were first made in go back, including those that buffers
            # made during construction share (the buffers wait on the host meanwhile).
            with buffers_on_host(model):
                empty_device_cache(reason="memory_saver_setup", ledger=self.ledger)
        if self.config.quantization == "fp8" and fp8_count == 0:
            logger.warning("quantization fp8: no projection of this model has dims that are "
                           "multiples of 16; every product runs in %s", self.dtype)
        elif fp8_count:
            logger.info("quantization fp8: %d projections run in fp8", fp8_count)
        return model.eval()

    @contextlib.contextmanager
    def _weights_region(self) -> Iterator[Placement]:
        """While open, every parameter is made in one `VmmRegion` (`self.weights_region`) as its
        module registers it (`tide.memory.placement`), so the weights are never resident twice.
        The region holds them in module order, checkpoint parameters first (a flattened update in
        that order then lands in place) and derived ones (the fp8 copies) after them."""
        from tide.memory.placement import placed, plan_layout
        from tide.memory.vmm import VmmRegion, region_nbytes

        def build() -> torch.nn.Module:
            model = self._construct()
            self._derive(model)
            return model

        layout = plan_layout(build)
        # Set at once: a start that fails from here on frees it (`_free_regions`).
        self.weights_region = VmmRegion(region_nbytes(list(layout.shapes)), self.device)
        homes = [self.weights_region.tensor(shape, dtype) for shape, dtype in layout.shapes]
        with placed(layout, homes) as placement:
            yield placement

    def _init_pools(self) -> None:
        """Size and allocate the KV pools. A hybrid model (full and sliding-window layers) gets two:
        the full pool for full layers and an SWA pool of `swa_full_tokens_ratio` as many slots for
        sliding layers, splitting the same budget (see memory/swa.py); others get one."""
        mc = self.model_config
        # Under tensor parallelism every rank must map full slots to SWA slots as rank 0's
        # allocator does; until the map travels with the batch, hybrid models keep one full pool
        # there (sliding layers still see only their window).
        hybrid = mc.is_hybrid and self.tp.size == 1
        sliding = [mc.layer_kind(i).is_sliding for i in range(mc.num_hidden_layers)]
        per_layer = MHATokenToKVPool.bytes_per_token(1, self.num_kv_heads, mc.head_dim,
                                                     self.kv_dtype)
        n_swa = sum(sliding) if hybrid else 0
        ratio = self.config.swa_full_tokens_ratio
        full_bytes, swa_bytes = per_layer * (mc.num_hidden_layers - n_swa), per_layer * n_swa
        if self.device.type == "cuda":
            import gc

            from tide.memory.release import empty_device_cache

            # Memory of unreachable engines (reference cycles not yet collected) and blocks cached
            # by the allocator (an earlier engine in this process, the weights' load) are free for
            # the pools: collect and hand them back so the driver counts them.
            gc.collect()
            empty_device_cache(reason="kv_cache_sizing", ledger=self.ledger)
            free = available_device_memory(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = free - total * (1.0 - self.config.mem_fraction_static)
            tokens = swa_pool_sizes(budget, full_bytes, swa_bytes, ratio)[0]
            if self.config.max_total_tokens is not None:
                tokens = min(tokens, self.config.max_total_tokens)
        else:
            tokens = self.config.max_total_tokens or _CPU_DEFAULT_MAX_TOTAL_TOKENS
            # The SWA pool of a hybrid model holds about `ratio` as many slots (below).
            need = tokens * full_bytes + int(tokens * ratio) * swa_bytes
            host = _host_memory_bytes()
            if host and need > host:
                raise ValueError(f"max_total_tokens {tokens} needs {need / 1e9:.1f} GB of KV cache, "
                                 f"more than this host's {host / 1e9:.1f} GB of memory")
        if tokens < 16:
            raise ValueError(
                f"not enough memory for the KV cache ({tokens} tokens); raise mem_fraction_static "
                "or max_total_tokens"
            )
        swa_tokens = 0
        if hybrid:
            assert mc.sliding_window is not None
            swa_tokens = max(int(tokens * ratio), min(tokens, min_swa_tokens(mc.sliding_window)))
            if swa_tokens > tokens * ratio:
                logger.warning("SWA KV pool raised to %d tokens (window %d) from "
                               "swa_full_tokens_ratio %.3f", swa_tokens, mc.sliding_window, ratio)
        self.max_total_tokens = tokens
        self.max_total_tokens_swa = swa_tokens
        n_req = self.config.max_running_requests
        region = None
        if hybrid:
            kv_shapes = SWAKVPool.layer_shapes(tokens, swa_tokens, sliding, self.num_kv_heads,
                                               mc.head_dim, self.kv_dtype)
        else:
            kv_shapes = [((tokens + 1, self.num_kv_heads, mc.head_dim), self.kv_dtype)] * (
                2 * mc.num_hidden_layers)
        if self.use_vmm:
            from tide.memory.vmm import VmmRegion, region_nbytes

            # The request table(s) go first; they are released and re-taken with the KV buffers.
            shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
                ((n_req + 1, self.context_len), torch.int32)] * (2 if hybrid else 1)
            region = VmmRegion(region_nbytes(shapes + kv_shapes), self.device)
        self.req_to_token_pool = ReqToTokenPool(n_req, self.context_len, self.device, region=region,
                                                swa=hybrid)
        if hybrid:
            allocator = SWATokenToKVPoolAllocator(tokens, swa_tokens, self.device)
            pool = SWAKVPool(tokens, swa_tokens, sliding, self.num_kv_heads, mc.head_dim,
                             self.kv_dtype, self.device, region=region)
            pool.register_mapping(allocator.full_to_swa_index_mapping)
            self.req_to_token_pool.register_swa_mapping(allocator.full_to_swa_index_mapping)
            self.token_to_kv_pool_allocator: TokenToKVPoolAllocator | SWATokenToKVPoolAllocator = (
                allocator)
            self.token_to_kv_pool: MHATokenToKVPool | SWAKVPool = pool
            logger.info("KV cache: %d full tokens (%d layers) + %d sliding-window tokens "
                        "(%d layers), %.1f MiB", tokens, mc.num_hidden_layers - n_swa, swa_tokens,
                        n_swa, (tokens * full_bytes + swa_tokens * swa_bytes) / 2**20)
            return
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            tokens, mc.num_hidden_layers, self.num_kv_heads, mc.head_dim, self.kv_dtype, self.device,
            region=region,
        )
        logger.info("KV cache: %d tokens, %.1f MiB", tokens, tokens * full_bytes / 2**20)

    def close(self) -> None:
        """Give back this runner's device memory (engine shutdown): captured graphs and their pool,
        KV pools and request tables, allocator state, attention scratch and weights. Storages are
        resized to 0 in place and VMM regions freed, so a reference kept anywhere (a test's
        `runner`, a fixture, a `with` target) to the model, a pool or one of their tensors pins no
        device memory; the allocator cache is then emptied (`engine_shutdown`). The runner cannot
        run afterwards; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self._staging = None
        self.last_greedy_ids = None
        owners: list[object] = [*self.model.modules(), self.req_to_token_pool,
                                self.token_to_kv_pool, self.attn_backend, self,
                                getattr(self.attn_backend, "_det_scratch", None)]
        # The allocators' free lists and the full->SWA map stay (a few bytes per slot): the
        # scheduler's accounting (`check_invariants`, `flush_cache`) still reads them.
        allocator = self.token_to_kv_pool_allocator
        kept = {t.untyped_storage().data_ptr() for t in _owned_tensors(
            [allocator, *(getattr(allocator, name, None) for name in ("full", "swa"))])}
        regions = [self.weights_region, self.token_to_kv_pool.region]
        graphs = self.cuda_graph_runner
        if graphs is not None:
            owners += [graphs, graphs.buffers]
            regions.append(graphs.logits_region)
            graphs.graphs.clear()  # the graphs and their memory pool
            graphs.pool = None
            self.cuda_graph_runner = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        freed: set[int] = kept
        for tensor in _owned_tensors(owners):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in freed or not storage.resizable():
                continue  # shared and already freed, or a view of a VMM region (freed below)
            freed.add(storage.data_ptr())
            storage.resize_(0)
        for region in regions:
            if region is not None:
                region.free()
        if self.device.type == "cuda":
            from tide.memory.release import empty_device_cache

            empty_device_cache(reason="engine_shutdown", ledger=self.ledger)

    def kv_layout(self) -> dict[str, object]:
        """The KV pools as `/get_server_info` shows them."""
        mc = self.model_config
        if isinstance(self.token_to_kv_pool, SWAKVPool):
            return {"type": "hybrid_swa", "full_tokens": self.max_total_tokens,
                    "swa_tokens": self.max_total_tokens_swa,
                    "full_layers": list(self.token_to_kv_pool.full_layer_ids),
                    "swa_layers": list(self.token_to_kv_pool.swa_layer_ids),
                    "sliding_window": mc.sliding_window,
                    "swa_full_tokens_ratio": self.config.swa_full_tokens_ratio,
                    "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch.")}
        return {"type": "full", "full_tokens": self.max_total_tokens,
                "full_layers": list(range(mc.num_hidden_layers)),
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch.")}

    @property
    def max_batch_size(self) -> int:
        return self.config.max_running_requests

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 device copy of `values`; small lists go through a pinned staging buffer (an async
        copy), reused once the previous copy out of it has completed. Larger ones (prefill index
        lists) convert through numpy: 16k values in ~150 us where `torch.tensor` takes ~650."""
        if self._staging is None or len(values) > self._staging.numel():
            host = torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))
            return host.to(self.device, non_blocking=True)
        self._staging_copied.synchronize()
        host = self._staging[: len(values)]
        host.numpy()[:] = values
        out = host.to(self.device, non_blocking=True)
        self._staging_copied.record()
        return out

    def _batch(self, mode: ForwardMode, input_ids: list[int] | torch.Tensor, positions: list[int],
               req_pool_indices: list[int], seq_lens: list[int], prefix_lens: list[int],
               extend_lens: list[int], out_cache_loc: torch.Tensor) -> ForwardBatch:
        # One host-to-device copy for all the index lists; the fields are views of it. Input ids
        # already on the device (the overlap schedule's previous tokens) are used as they are.
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids: list[int] = [] if on_device else input_ids  # type: ignore[assignment]
        packed = self._to_device(host_ids + positions + req_pool_indices + seq_lens)
        t, b = len(positions), len(seq_lens)
        ids = input_ids if on_device else packed[:t]
        packed = packed[len(host_ids):]
        return ForwardBatch(
            mode=mode,
            input_ids=ids,  # type: ignore[arg-type]
            positions=packed[:t],
            req_pool_indices=packed[t : t + b],
            seq_lens=packed[t + b :],
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            out_cache_loc_swa=self._swa_loc(out_cache_loc),
        )

    def _swa_loc(self, out_cache_loc: torch.Tensor) -> torch.Tensor | None:
        """The new tokens' SWA slots (hybrid models; one device gather per forward), else None."""
        pool = self.token_to_kv_pool
        return pool.translate(out_cache_loc) if isinstance(pool, SWAKVPool) else None

    @torch.inference_mode()
    def forward_extend(
        self,
        input_ids: list[int],
        positions: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        score: PromptScoring | None = None,
    ) -> torch.Tensor:
        """Prefill/extend: fp32 logits [B, vocab] of each request's last new token. `score`: input
        logprobs to compute on the way (filled in place; every tensor-parallel rank runs the same
        pieces, since the output head gathers the vocabulary across ranks)."""
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        fb = self._batch(ForwardMode.EXTEND, input_ids, positions, req_pool_indices, seq_lens,
                         prefix_lens, extend_lens, out_cache_loc)
        if score is not None and score.rows:
            fb.score_rows = self._to_device(score.rows)
        self.attn_backend.init_forward_metadata(fb)
        logits = self.model(fb.input_ids, fb.positions, fb)
        if fb.scored_hidden is not None and score is not None:
            self._score(fb.scored_hidden, score)
        return logits

    def _score(self, hidden: torch.Tensor, score: PromptScoring) -> None:
        """`score`'s logprobs from the final hidden states of its rows, through the output head a
        piece of at most SCORE_PIECE_LOGITS logits at a time (a long prompt's [rows, vocab] logits
        would not fit beside the KV cache)."""
        targets = self._to_device(score.targets)
        temps = torch.tensor(score.temperatures, dtype=torch.float32).to(self.device,
                                                                          non_blocking=True)
        step = max(1, SCORE_PIECE_LOGITS // self.model_config.vocab_size)
        deterministic = self.config.enable_deterministic_inference
        # Every model class has it (tide/models); nn.Module's attribute type does not say so.
        compute_logits = cast(Callable[[torch.Tensor], torch.Tensor], self.model.compute_logits)
        parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for i in range(0, hidden.shape[0], step):
            logits = compute_logits(hidden[i : i + step])
            parts.append(score_logits(logits, targets[i : i + step], temps[i : i + step],
                                      score.top, deterministic))
            del logits
        score.logprobs = torch.cat([p[0] for p in parts])
        if score.top > 0:
            score.top_vals = torch.cat([p[1] for p in parts])  # type: ignore[misc]
            score.top_ids = torch.cat([p[2] for p in parts])  # type: ignore[misc]

    @torch.inference_mode()
    def forward_decode(
        self,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request at `positions` (= KV length before this step): records
        `out_cache_loc` as each request's slot at its position in req_to_token, then returns
        logits [B, vocab]. `input_ids` may be a device tensor (int64). After a CUDA-graph replay
        the logits are a view of the graphs' shared buffer, in the model's dtype, and
        `last_greedy_ids` holds each row's argmax: both are valid until the next replay.
        Eager: new fp32 logits, `last_greedy_ids` None."""
        bs = len(input_ids)
        seq_lens = [p + 1 for p in positions]
        self.last_greedy_ids = None
        graphs = self.cuda_graph_runner
        bucket = graphs.bucket(bs) if graphs is not None else None
        if graphs is None or bucket is None:
            fb = self._batch(ForwardMode.DECODE, input_ids, positions, req_pool_indices, seq_lens,
                             positions, [1] * bs, out_cache_loc)
            fb.record_decode_slots()
            self.attn_backend.init_forward_metadata(fb)
            return self.model(fb.input_ids, fb.positions, fb)
        pad = bucket - bs
        if pad:
            if isinstance(input_ids, torch.Tensor):
                input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            else:
                input_ids = input_ids + [0] * pad
            positions = positions + [0] * pad
            req_pool_indices = req_pool_indices + [self.req_to_token_pool.dummy_slot] * pad
            seq_lens = seq_lens + [1] * pad
            out_cache_loc = torch.cat([out_cache_loc, out_cache_loc.new_zeros(pad)])
        fb = self._batch(ForwardMode.DECODE, input_ids, positions, req_pool_indices, seq_lens,
                         positions, [1] * bucket, out_cache_loc)
        logits, self.last_greedy_ids = graphs.replay(fb, bs)
        return logits


def _host_memory_bytes() -> int:
    """This host's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
