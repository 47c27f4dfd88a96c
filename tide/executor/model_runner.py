"""Owns the model, the KV pools and the attention backend; runs one forward per call."""

from __future__ import annotations

import logging

import torch

from tide.config import EngineConfig
from tide.executor.forward_batch import ForwardBatch, ForwardMode
from tide.layers.attention import get_attention_backend_class
from tide.memory.device import available_device_memory
from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.weights import init_dummy_weights, load_checkpoint

logger = logging.getLogger(__name__)

_CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    dtype = model_config.checkpoint_dtype
    return torch.bfloat16 if dtype == torch.float32 else dtype


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.context_len = config.context_length or model_config.max_position_embeddings
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = self._load_model()
        self._init_pools()
        self.attn_backend = get_attention_backend_class(config.attention_backend)()

    def _load_model(self) -> torch.nn.Module:
        cls = get_model_class(self.model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_checkpoint(model, self.config.model_path, self.config.show_progress)
        return model.eval()

    def _init_pools(self) -> None:
        mc = self.model_config
        per_token = MHATokenToKVPool.bytes_per_token(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.dtype
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
        self.req_to_token_pool = ReqToTokenPool(
            self.config.max_running_requests, self.context_len, self.device
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            tokens, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.dtype, self.device
        )
        logger.info("KV cache: %d tokens, %.1f MiB", tokens, tokens * per_token / 2**20)

    def make_forward_batch(
        self,
        mode: ForwardMode,
        input_ids: list[int],
        positions: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
    ) -> ForwardBatch:
        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        return ForwardBatch(
            mode=mode,
            input_ids=dev(input_ids),
            positions=dev(positions),
            req_pool_indices=dev(req_pool_indices),
            seq_lens=dev(seq_lens),
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
        )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [B, vocab] of each request's last new token."""
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
