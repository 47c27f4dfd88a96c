"""Trainer-side reference logprobs for RL: `logprobs(model, input_ids, output_ids)`.

On-policy RL needs the trainer's logprobs of a rollout to equal the engine's. Two separate
implementations of the same network (transformers' and tide's) do not give the same bits: they order
their float operations differently (fused vs separate projections, attention kernels, RoPE rounding).
So this reference does not run the trainer's module: it reads that module's weights into tide's own
model class (the one the engine runs, with the same fused projections and name mapping) and runs it
with the batch-invariant ops of `enable_deterministic_inference`: batch-invariant matmuls, and
attention computed one query row at a time over exactly its visible keys. One prefill over
`input_ids + output_ids` then performs, for every output token, the same sequence of operations the
engine performed in its prefill and decode steps, so the logprobs equal a deterministic engine's bit for
bit (same weights, dtype and device). On CUDA it runs the Triton kernels of
`tide.layers.batch_invariant_triton`, the ones a deterministic engine runs there. Against a
default-mode engine they agree to about 1e-6 in fp32 on CPU (tests/test_rl.py measures it).

Limits: architectures tide serves (`tide.models.registry`: Llama, Mistral, Qwen2, Qwen3, Gemma 2/3
text), given as a transformers `PreTrainedModel` whose `named_parameters()` use checkpoint names;
CPU or CUDA (the engine must run on the same device type, with the module's dtype); no gradients
(the result is a list of floats: use it for the importance ratio / as the old-policy logprob, and
compute the differentiable logprobs with the trainer's own forward). The K/V of the scored sequence
live in scratch buffers for the one call; nothing is cached between calls. The weights are copied into
tide's layout on every call (the trainer changes them between calls). Of the sampling parameters
only the temperature is modelled (below 1e-5: greedy, scored at 1, as the engine does); the engine's
logprobs of a request with repetition/frequency/presence penalties, a `logit_bias` or (before its
`min_new_tokens`) banned ending tokens come from the edited logits.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tide.executor.forward_batch import ForwardBatch, ForwardMode
from tide.layers import batch_invariant
from tide.layers.attention import AttentionBackend, select_attention_backend
from tide.layers.attention.torch_native import TorchNativeAttnBackend
from tide.layers.batch_invariant import set_batch_invariant
from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.sampling_params import GREEDY_TEMPERATURE
from tide.weights.mapping import WeightMap

__all__ = ["logprobs"]


@dataclass
class _ScoringBatch(ForwardBatch):
    """One request's extend whose logits are wanted at `rows` (indices into its tokens), not only at
    its last token."""

    rows: torch.Tensor | None = None

    def last_token_indices(self) -> torch.Tensor:
        assert self.rows is not None  # set by _Reference.logprobs
        return self.rows


class _Reference:
    """tide's model class for one trainer module, with batch-invariant ops and scratch KV."""

    def __init__(self, hf_model: nn.Module) -> None:
        config = getattr(hf_model, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            raise ValueError("model must be a transformers PreTrainedModel (it has no .config)")
        hf = config.to_dict()
        if not hf.get("architectures"):
            hf["architectures"] = [type(hf_model).__name__]
        self.model_config = ModelConfig.from_hf_dict(hf)
        first = next(hf_model.parameters())
        self.device = first.device
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"model must be on CPU or CUDA, not {self.device.type!r}")
        self.dtype = first.dtype
        cls = get_model_class(self.model_config.architecture)
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = cls(self.model_config).eval()
        finally:
            torch.set_default_dtype(default)
        set_batch_invariant(self.model)
        self.weight_map = WeightMap(self.model)
        # The backend an engine with attention_backend="auto" picks on this device, in its
        # deterministic form: the same kernels as the engine's deterministic steps.
        backend_cls = select_attention_backend("auto", self.device.type, self.model_config)
        if backend_cls is TorchNativeAttnBackend:
            self.backend: AttentionBackend = TorchNativeAttnBackend(deterministic=True)
        else:
            mc = self.model_config
            self.backend = backend_cls(mc.num_attention_heads, mc.num_key_value_heads,  # type: ignore[call-arg]
                                       mc.head_dim, 1, self.device, deterministic=True,
                                       dtype=self.dtype)

    def load(self, hf_model: nn.Module) -> None:
        named = [(n, p.detach()) for n, p in hf_model.named_parameters()]
        targets = self.weight_map.plan([(n, tuple(t.shape), t.dtype) for n, t in named],
                                       require_complete=True)
        tensors = dict(named)
        with torch.no_grad():
            for target in targets:
                self.weight_map.write(target, tensors[target.name])

    @torch.inference_mode()
    def logprobs(self, input_ids: list[int], output_ids: list[int],
                 temperature: float) -> list[float]:
        mc = self.model_config
        tokens = input_ids + output_ids[:-1]
        n = len(tokens)
        dev = self.device
        req_pool = ReqToTokenPool(1, n, dev)
        kv_pool = MHATokenToKVPool(n, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                   self.dtype, dev)
        # slot 0 is the pool's padding slot
        slots = torch.arange(1, n + 1, dtype=torch.int64, device=dev)
        req_pool.write(0, 0, slots.to(torch.int32))
        fb = _ScoringBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=dev),
            positions=torch.arange(n, dtype=torch.int64, device=dev),
            req_pool_indices=torch.zeros(1, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int64, device=dev),
            out_cache_loc=slots,
            req_to_token_pool=req_pool,
            token_to_kv_pool=kv_pool,
            attn_backend=self.backend,
            seq_lens_cpu=[n],
            prefix_lens_cpu=[0],
            extend_lens_cpu=[n],
            rows=torch.arange(len(input_ids) - 1, n, dtype=torch.int64, device=dev),
        )
        self.backend.init_forward_metadata(fb)
        logits = self.model(fb.input_ids, fb.positions, fb).float()  # [len(output_ids), vocab]
        # The sampler's math: logits / temperature (0 counts as 1), then log_softmax per row.
        temps = torch.full((logits.shape[0], 1), temperature or 1.0, device=dev)
        logp = batch_invariant.log_softmax(logits / temps)
        ids = torch.tensor(output_ids, dtype=torch.int64, device=dev).unsqueeze(1)
        return logp.gather(1, ids).squeeze(1).tolist()


_REFERENCES: "weakref.WeakKeyDictionary[nn.Module, _Reference]" = weakref.WeakKeyDictionary()


def logprobs(model: nn.Module, input_ids: list[int], output_ids: list[int],
             temperature: float = 1.0) -> list[float]:
    """Per-token logprobs of `output_ids` following `input_ids` under `model` (a transformers causal
    LM on CPU or CUDA, typically the module being trained): one float per output token, as the engine reports
    them in `meta_info["output_token_logprobs"]` (log_softmax of logits / `temperature`, before any
    top-k/top-p truncation). Equal bit for bit to an engine with `enable_deterministic_inference`
    that holds the same weights; see the module doc for why and for the limits."""
    for name, ids in (("input_ids", input_ids), ("output_ids", output_ids)):
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            raise ValueError(f"{name} must be a list of ints")
    if not input_ids:
        raise ValueError("input_ids must not be empty")
    if not output_ids:
        return []
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature < GREEDY_TEMPERATURE:
        temperature = 0.0  # greedy, as the engine stores it: logprobs at temperature 1
    ref = _REFERENCES.get(model)
    first = next(model.parameters(), None)
    if ref is None or first is None or (ref.dtype, ref.device) != (first.dtype, first.device):
        # A module moved to another dtype or device since the last call (`model.to(...)`) gets a
        # reference of its new dtype and device: the engine it must equal computes in those.
        ref = _Reference(model)
        _REFERENCES[model] = ref
    vocab = ref.model_config.vocab_size
    bad = [t for t in input_ids + output_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids must be in [0, {vocab}), got {bad[0]}")
    if len(input_ids) + len(output_ids) > ref.model_config.max_position_embeddings:
        raise ValueError("input_ids + output_ids exceed the model's max_position_embeddings")
    ref.load(model)
    return ref.logprobs(input_ids, output_ids, float(temperature))
