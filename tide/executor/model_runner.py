"""Owns the model, the KV pools and the attention backend; runs one forward per call."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tide.config import EngineConfig
from tide.executor.cuda_graph_runner import CudaGraphRunner, default_batch_sizes
from tide.executor.forward_batch import ForwardBatch, ForwardMode
from tide.layers.attention import select_attention_backend
from tide.layers.batch_invariant import set_batch_invariant
from tide.memory.ledger import MemoryLedger
from tide.memory.observe import available_device_memory
from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.parallel import TpGroup, tp_context
from tide.weights import init_dummy_weights, load_checkpoint

if TYPE_CHECKING:
    from tide.memory.vmm import VmmRegion

logger = logging.getLogger(__name__)

_CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
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
        self.context_len = config.context_length or model_config.max_position_embeddings
        if self.context_len > model_config.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_len} exceeds the model's max_position_embeddings "
                f"{model_config.max_position_embeddings}"
            )
        if config.enable_deterministic_inference and self.device.type != "cpu":
            raise ValueError(
                "enable_deterministic_inference is supported on CPU only for now (no "
                f"batch-invariant kernels for device {self.device.type!r} yet); use device='cpu'"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = self._load_model()
        if config.enable_deterministic_inference:
            set_batch_invariant(self.model)
        # Memory saver on CUDA: weights and KV live in address-stable regions, so release/resume
        # keeps every pointer a captured CUDA graph holds.
        self.use_vmm = False
        self.weights_region = None
        if config.enable_memory_saver and self.device.type == "cuda":
            from tide.memory.vmm import vmm_available

            self.use_vmm = vmm_available()
            if self.use_vmm:
                self.weights_region = self._move_weights_to_vmm()
        self._init_pools()
        backend_cls = select_attention_backend(
            config.attention_backend, self.device.type, model_config
        )
        self.attn_backend = backend_cls.create(self)
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

    def _load_model(self) -> torch.nn.Module:
        cls = get_model_class(self.model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), tp_context(self.tp):
                model = cls(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_checkpoint(model, self.config.model_path, self.config.show_progress)
        return model.eval()

    def _move_weights_to_vmm(self) -> "VmmRegion":
        from tide.memory.release import empty_device_cache
        from tide.memory.vmm import VmmRegion, region_nbytes

        params = list(self.model.parameters())
        region = VmmRegion(region_nbytes([(tuple(p.shape), p.dtype) for p in params]), self.device)
        for p in params:
            view = region.tensor(tuple(p.shape), p.dtype)
            view.copy_(p.data)
            p.data = view
        torch.cuda.synchronize(self.device)
        # The weights' first home goes back.
        empty_device_cache(reason="memory_saver_setup", ledger=self.ledger)
        return region

    def _init_pools(self) -> None:
        mc = self.model_config
        per_token = MHATokenToKVPool.bytes_per_token(
            mc.num_hidden_layers, self.num_kv_heads, mc.head_dim, self.dtype
        )
        if self.device.type == "cuda":
            free = available_device_memory(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = free - total * (1.0 - self.config.mem_fraction_static)
            tokens = int(budget // per_token)
            if self.config.max_total_tokens is not None:
                tokens = min(tokens, self.config.max_total_tokens)
        else:
            tokens = self.config.max_total_tokens or _CPU_DEFAULT_MAX_TOTAL_TOKENS
        if tokens < 16:
            raise ValueError(
                f"not enough memory for the KV cache ({tokens} tokens); raise mem_fraction_static "
                "or max_total_tokens"
            )
        self.max_total_tokens = tokens
        n_req = self.config.max_running_requests
        kv_shape = ((tokens + 1, self.num_kv_heads, mc.head_dim), self.dtype)
        region = None
        if self.use_vmm:
            from tide.memory.vmm import VmmRegion, region_nbytes

            # The request table goes first; it is released and re-taken with the KV buffers.
            shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
                ((n_req + 1, self.context_len), torch.int32)]
            shapes += [kv_shape] * 2 * mc.num_hidden_layers
            region = VmmRegion(region_nbytes(shapes), self.device)
        self.req_to_token_pool = ReqToTokenPool(n_req, self.context_len, self.device, region=region)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            tokens, mc.num_hidden_layers, self.num_kv_heads, mc.head_dim, self.dtype, self.device,
            region=region,
        )
        logger.info("KV cache: %d tokens, %.1f MiB", tokens, tokens * per_token / 2**20)

    @property
    def max_batch_size(self) -> int:
        return self.config.max_running_requests

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 device copy of `values`; small lists go through a pinned staging buffer (an async
        copy), reused once the previous copy out of it has completed."""
        if self._staging is None or len(values) > self._staging.numel():
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)
        self._staging_copied.synchronize()
        host = self._staging[: len(values)]
        host.numpy()[:] = values
        out = host.to(self.device, non_blocking=True)
        self._staging_copied.record()
        return out

    def _batch(self, mode: ForwardMode, input_ids: list[int], positions: list[int],
               req_pool_indices: list[int], seq_lens: list[int], prefix_lens: list[int],
               extend_lens: list[int], out_cache_loc: torch.Tensor) -> ForwardBatch:
        # One host-to-device copy for all four index lists; the fields are views of it.
        packed = self._to_device(input_ids + positions + req_pool_indices + seq_lens)
        t, b = len(input_ids), len(seq_lens)
        return ForwardBatch(
            mode=mode,
            input_ids=packed[:t],
            positions=packed[t : 2 * t],
            req_pool_indices=packed[2 * t : 2 * t + b],
            seq_lens=packed[2 * t + b :],
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
        )

    @torch.inference_mode()
    def forward_extend(
        self,
        input_ids: list[int],
        positions: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
    ) -> torch.Tensor:
        """Prefill/extend: fp32 logits [B, vocab] of each request's last new token."""
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        fb = self._batch(ForwardMode.EXTEND, input_ids, positions, req_pool_indices, seq_lens,
                         prefix_lens, extend_lens, out_cache_loc)
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def forward_decode(
        self,
        input_ids: list[int],
        positions: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request at `positions` (= KV length before this step): records
        `out_cache_loc` as each request's slot at its position in req_to_token, then returns
        logits [B, vocab]. After a CUDA-graph replay the logits are a view of the graphs' shared
        buffer and `last_greedy_ids` holds each row's argmax: both are valid until the next replay.
        Eager: new logits, `last_greedy_ids` None."""
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
            input_ids = input_ids + [0] * pad
            positions = positions + [0] * pad
            req_pool_indices = req_pool_indices + [self.req_to_token_pool.dummy_slot] * pad
            seq_lens = seq_lens + [1] * pad
            out_cache_loc = torch.cat([out_cache_loc, out_cache_loc.new_zeros(pad)])
        fb = self._batch(ForwardMode.DECODE, input_ids, positions, req_pool_indices, seq_lens,
                         positions, [1] * bucket, out_cache_loc)
        logits, self.last_greedy_ids = graphs.replay(fb, bs)
        return logits
