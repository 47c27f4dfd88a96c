"""Engine configuration: one frozen, validated dataclass.

`EngineConfig.from_kwargs` rejects unknown keys with a `ValueError` naming them, so a typo in an option
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEMO_MODEL_PATH = str(Path(__file__).parent / "demo_model")

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)
GRAMMAR_BACKENDS = ("xgrammar", "none")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_SEED = 2**63 - 1
MAX_DP_RANK = 4096  # data-parallel replicas an engine can be one of
# Decode kernels put the batch on a grid axis of at most 65535 programs.
MAX_RUNNING_REQUESTS = 65535


def _option(default: Any, help: str) -> Any:
    """A field with its help text: the one description `tide --help`, docs/python_api.md and
    `option_help` read."""
    return dataclasses.field(default=default, metadata={"help": help})


def option_help(name: str) -> str:
    """The help text of `EngineConfig` field `name`."""
    return str(EngineConfig.__dataclass_fields__[name].metadata["help"])


@dataclass(frozen=True)
class EngineConfig:
    """Options of an engine. Field names follow sglang's `ServerArgs` where sglang has the concept.

    Every field carries its help text in `dataclasses.field(metadata={"help": ...})`; the CLI's
    option help is read from there."""

    model_path: str = _option(DEMO_MODEL_PATH, "Hugging Face model directory (config.json, "
                              "*.safetensors, tokenizer files); default: the built-in demo model")
    tokenizer_path: str | None = _option(None, "tokenizer directory (default: model_path)")
    skip_tokenizer_init: bool = _option(
        False, "load no tokenizer: requests are token ids in, token ids out (text inputs and stop "
               "strings are refused); the checkpoint needs no tokenizer files")
    load_format: str = _option("auto", "auto or safetensors: read the checkpoint; dummy: random "
                                       "weights of the model's shapes (tests, benchmarks)")
    dtype: str = _option("auto", "weight and activation dtype: auto (on GPU the checkpoint's "
                                 "torch_dtype, bfloat16 for a float32 checkpoint; float32 on CPU), "
                                 "float32, bfloat16 or float16")
    device: str = _option("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    seed: int = _option(0, "seed of dummy weights and of sampling for requests that pass no seed")
    dp_rank: int = _option(
        0, "this engine's index among data-parallel replicas (set by --dp-size and RayEngine): "
           "requests that pass no seed draw from a stream of this replica's own, so replicas do "
           "not repeat each other's draws; dummy weights and seeded requests do not depend on it")
    context_length: int | None = _option(
        None, "longest prompt + output in tokens (default: the model's max_position_embeddings)")
    attention_backend: str = _option("auto", "auto (triton on CUDA, torch_native elsewhere), "
                                             "triton or torch_native")
    tp_size: int = _option(1, "tensor-parallel ranks: the model is split over this many GPUs of "
                              "this host (one process per rank; on CPU, gloo processes)")
    disable_custom_all_reduce: bool = _option(
        False, "with tp_size > 1 on GPUs: sum small tensors (decode steps) with NCCL instead of the "
               "one-shot all-reduce over peer memory")
    disable_cuda_graph: bool = _option(False, "run decode eagerly instead of replaying CUDA graphs")
    cuda_graph_max_bs: int = _option(
        512, "largest decode batch captured as a CUDA graph (at most max_running_requests)")
    # Memory pools.
    mem_fraction_static: float = _option(
        0.85, "fraction of the GPU's total memory for weights + KV cache (the rest is activations "
              "and the allocator's slack); lower it if a colocated process needs memory")
    max_total_tokens: int | None = _option(
        None, "KV cache size in tokens; on GPU at most what mem_fraction_static leaves after the "
              "weights (default: all of that), on CPU default 32768")
    max_running_requests: int = _option(256, "most requests decoding at once")
    swa_full_tokens_ratio: float = _option(
        0.8, "hybrid sliding-window models (full and sliding layers, e.g. Gemma-2/3): slots of the "
             "sliding-window KV pool per slot of the full pool, in (0, 1]; the memory budget is "
             "split so both pools fit (smaller: more full-context tokens, fewer concurrent windows)")
    kv_cache_dtype: str = _option(
        "auto", "KV cache element type: auto (the model dtype) or fp8_e4m3 (one byte per value, "
                "saturated to +-448, no scales: twice the tokens in the same memory and half the "
                "bytes each decode step reads; logprobs move by the rounding). The triton "
                "attention kernels read fp8 on compute capability 8.9+; older GPUs run torch_native")
    quantization: str | None = _option(
        None, "fp8: the decoder's projections run in float8_e4m3 with a scale per output channel "
              "and per token (W8A8, fp8 tensor cores on compute capability 8.9+; the output head "
              "keeps the model dtype). The model-dtype weights stay loaded as the master copy "
              "every load and update writes (1.5x the weight memory); the fp8 copy is refreshed "
              "when an update finishes. Tokens and logprobs move by the rounding")
    # Scheduling.
    chunked_prefill_size: int = _option(8192, "longest prefill chunk in tokens; longer prompts "
                                              "are prefilled over several steps")
    max_prefill_tokens: int = _option(16384, "most prompt tokens one prefill batch takes")
    disable_radix_cache: bool = _option(False, "do not reuse cached prompt prefixes across requests")
    disable_overlap_schedule: bool = _option(
        False, "run each decode step to the end before scheduling the next (the overlap schedule "
               "prepares step N+1 while the GPU runs step N; it is used on CUDA only)")
    enable_mixed_chunk: bool = _option(
        False, "running requests decode in the same forward as a prefill batch instead of waiting "
               "for it")
    grammar_backend: str = _option(
        "xgrammar", "constrained decoding (json_schema, regex, ebnf, response_format): xgrammar "
                    "(needs the xgrammar package: pip install 'tide[grammar]') or none (such "
                    "requests are refused)")
    # Releasing memory to a colocated trainer (release/resume_memory_occupation).
    enable_memory_saver: bool = _option(
        False, "allocate KV cache, weights and CUDA graphs so release_memory_occupation / "
               "resume_memory_occupation can give their memory back and take it again")
    enable_cpu_backup: bool = _option(False, "with enable_memory_saver: keep a pinned host copy of "
                                             "the weights while released, restored on resume")
    schedule_conservativeness: float = _option(
        1.0, "accepted for sglang compatibility (must be > 0); the scheduler does not read it yet")
    # RL fidelity (see docs/rl.md).
    enable_deterministic_inference: bool = _option(
        False, "batch-invariant ops: the same prompt and seed give the same tokens and logprobs "
               "whatever shares the batch, chunked prefill or a cached prefix (CPU and CUDA)")
    # Loading.
    show_progress: bool | None = _option(None, "show a progress bar while loading weights "
                                               "(default: for checkpoints of 1 GiB or more)")
    log_level: str = _option("warning", "log level of the tide loggers (debug, info, warning, error)")

    def __post_init__(self) -> None:
        _check_types(self)
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed}")
        if not 0 <= self.dp_rank < MAX_DP_RANK:
            raise ValueError(f"dp_rank must be an integer in [0, {MAX_DP_RANK}), got {self.dp_rank}")
        if self.device != "auto":
            import torch

            try:
                kind = torch.device(self.device).type
            except (RuntimeError, TypeError):
                kind = None
            if kind not in ("cpu", "cuda"):
                raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        if self.tokenizer_path is not None and not os.path.isdir(self.tokenizer_path):
            raise ValueError(f"tokenizer_path must be a directory, got {self.tokenizer_path!r}")
        if self.enable_cpu_backup and not self.enable_memory_saver:
            raise ValueError("enable_cpu_backup needs enable_memory_saver (the backup is of the "
                             "weights that release_memory_occupation gives back)")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format != "dummy" and not os.path.isdir(self.model_path):
            raise ValueError(f"model_path must be a model directory, got {self.model_path!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        _positive("max_total_tokens", self.max_total_tokens, allow_none=True)
        _positive("context_length", self.context_length, allow_none=True)
        _positive("max_running_requests", self.max_running_requests)
        if self.max_running_requests > MAX_RUNNING_REQUESTS:
            raise ValueError(f"max_running_requests must be at most {MAX_RUNNING_REQUESTS} (a decode "
                             f"batch is one axis of a CUDA grid), got {self.max_running_requests}")
        _positive("tp_size", self.tp_size)
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(
                f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got "
                             f"{self.grammar_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.enable_deterministic_inference:
            raise ValueError(
                "kv_cache_dtype fp8_e4m3 cannot be combined with enable_deterministic_inference: "
                "tide.rl.logprobs (the trainer-side reference) keeps K/V in the model dtype")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantization is not None and self.enable_deterministic_inference:
            raise ValueError(
                "quantization fp8 cannot be combined with enable_deterministic_inference: "
                "tide.rl.logprobs (the trainer-side reference) computes in the model dtype")
        _positive("cuda_graph_max_bs", self.cuda_graph_max_bs)
        _positive("chunked_prefill_size", self.chunked_prefill_size)
        _positive("max_prefill_tokens", self.max_prefill_tokens)
        if not self.schedule_conservativeness > 0 or not math.isfinite(self.schedule_conservativeness):
            raise ValueError(
                f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; allowed options are {sorted(known)}"
            )
        if kwargs.get("model_path") is None:
            kwargs.pop("model_path", None)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _check_types(config: EngineConfig) -> None:
    """ValueError naming the field whose value is not of its annotated type (bool, int, float, str,
    or None where allowed): a string "false" for a bool flag would otherwise turn it on."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kinds = [k.strip() for k in str(f.type).split("|")]
        if value is None and "None" in kinds:
            continue
        ok = any(
            (k == "bool" and isinstance(value, bool))
            or (k == "int" and isinstance(value, int) and not isinstance(value, bool))
            or (k == "float" and isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
            or (k == "str" and isinstance(value, str))
            for k in kinds)
        if not ok:
            names = {"float": "a finite number", "int": "an integer", "bool": "a bool",
                     "str": "a string", "None": "None"}
            want = " or ".join(names.get(k, k) for k in kinds)
            raise ValueError(f"{f.name} must be {want}, got {value!r}")


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
