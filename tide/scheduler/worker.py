"""The worker interface the scheduler drives, and the in-process worker behind it.

The scheduler never calls the model: it hands a prepared `ScheduleBatch` to `worker.forward` and gets
back the sampled tokens. A worker also owns what lives next to the model: the KV pools the scheduler
allocates from, the weight updater and memory occupation that the handover drives. `TpModelWorker`
runs everything in this process (one device); tensor parallelism puts one worker per rank behind the
same interface.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from tide.config import EngineConfig
from tide.executor.model_runner import ModelRunner
from tide.layers.sampler import DeviceSample, SampleOutput, Sampler, SamplingBatchInfo
from tide.memory.ledger import MemoryLedger
from tide.memory.occupation import MemoryOccupation
from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator
from tide.memory.release import empty_device_cache
from tide.memory.swa import SWATokenToKVPoolAllocator
from tide.model_config import ModelConfig
from tide.parallel import TpGroup
from tide.scheduler.profile import ProfileOptions, RankProfile
from tide.scheduler.schedule_batch import ScheduleBatch
from tide.weights.update import WeightUpdater

logger = logging.getLogger(__name__)


class SampleFuture:
    """The sampled tokens of a launched batch. `next_ids` is on the device (None when the worker
    sampled on the host) and may feed the next step's inputs; `result()` gives the host lists,
    waiting for this batch's results only."""

    def __init__(self, sample: DeviceSample | None = None,
                 output: SampleOutput | None = None) -> None:
        self._sample = sample
        self._output = output

    @property
    def next_ids(self) -> torch.Tensor | None:
        return self._sample.next_ids if self._sample is not None else None

    def result(self) -> SampleOutput:
        if self._output is None:
            assert self._sample is not None
            self._output = self._sample.to_output()
            self._sample = None
        return self._output


class ModelWorker(ABC):
    """Runs batches and holds the model-side state.

    Invariants: `req_to_token_pool` and `token_to_kv_pool_allocator` are the pools of the KV the model
    reads (the scheduler allocates from them; the worker never does); `max_total_tokens` KV slots
    exist; a sequence never exceeds `context_len` tokens.
    """

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator | SWATokenToKVPoolAllocator
    max_total_tokens: int
    context_len: int
    weight_updater: WeightUpdater
    memory_occupation: MemoryOccupation

    @abstractmethod
    def forward(self, batch: ScheduleBatch) -> SampleOutput:
        """Run `batch` (its KV slots assigned, its inputs filled) and sample the next token of each of
        its sampled rows, in order; a row whose sampling fails is listed in `failed`, the others are
        still sampled. For a decode batch the worker records each request's new KV slot in
        `req_to_token` at its position (inside the captured graph on CUDA)."""

    @abstractmethod
    def device_info(self) -> dict[str, str]:
        """`{"device", "dtype"}` of the model, for server info."""

    def empty_device_cache(self, reason: str) -> None:
        """Empty the device allocator cache of every rank (a named release point on each)."""
        empty_device_cache(reason=reason, ledger=getattr(self, "ledger", None))

    def rank_ledgers(self) -> list[dict]:
        """Each tensor-parallel rank's memory ledger (`MemoryLedger.to_dict`), rank 0 first; empty
        for one rank (the engine's own ledger is that rank's)."""
        return []

    def rank_memory(self) -> list[dict]:
        """Each tensor-parallel rank's device memory, released bytes by tag and release totals by
        reason (`/metrics` reports them per rank); empty for one rank."""
        return []

    def shutdown(self) -> None:  # noqa: B027 - a no-op unless the worker holds something
        """Stop whatever the worker started (rank processes) and give its device memory back."""

    def start_profile(self, options: ProfileOptions, rank: int = 0) -> None:
        """Start profiling this worker's forwards (every rank's, under tensor parallelism);
        RuntimeError if a profile is running."""
        if getattr(self, "_profile", None) is not None:
            raise RuntimeError("a profile is already running (stop_profile first)")
        self._profile: RankProfile | None = RankProfile(options, rank, self.profile_device())

    def stop_profile(self) -> list[str]:
        """Stop profiling; the files written, every rank's. RuntimeError if none is running."""
        profile = getattr(self, "_profile", None)
        if profile is None:
            raise RuntimeError("no profile is running (start_profile first)")
        self._profile = None
        return profile.stop()

    def profile_device(self) -> torch.device:
        """The device whose kernels a profile records."""
        return torch.device("cpu")
    # Whether `forward_launch` returns before the device finishes (the overlap scheduler pays off).
    supports_overlap: bool = False

    def forward_launch(self, batch: ScheduleBatch) -> SampleFuture:
        """Start `batch` and return its tokens as a future (this default runs it to the end). A decode
        batch's `input_ids_device`, when set, replaces `input_ids`: the previous step's tokens, never
        copied to the host."""
        return SampleFuture(output=self.forward(batch))

    def kv_layout(self) -> dict[str, object]:
        """The KV pools' layout, for server info (one full pool unless a worker says otherwise)."""
        return {"type": "full", "full_tokens": self.max_total_tokens}


class TpModelWorker(ModelWorker):
    """The in-process worker: a `ModelRunner` (model, pools, attention backend, CUDA graphs) and the
    sampler, on one device."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 ledger: MemoryLedger, tp: TpGroup | None = None) -> None:
        """`tp`: the tensor-parallel group this worker is one rank of (None: the whole model)."""
        self.ledger = ledger
        self.model_runner = ModelRunner(config, model_config, ledger, tp)
        runner = self.model_runner
        self.sampler = Sampler(config.seed, config.enable_deterministic_inference,
                               stream=config.dp_rank)
        # Logits come in the model's dtype from a decode graph, in fp32 otherwise.
        self.sampler.warmup(model_config.vocab_size, (runner.dtype, torch.float32), runner.device)
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator
        self.max_total_tokens = runner.max_total_tokens
        self.context_len = runner.context_len
        self.weight_updater = WeightUpdater(runner.model, runner.device)
        self.memory_occupation = MemoryOccupation(runner, config.enable_cpu_backup, ledger)
        self.supports_overlap = runner.device.type == "cuda"

    def profile_device(self) -> torch.device:
        return self.model_runner.device

    def shutdown(self) -> None:
        """Give the model's, the pools' and the graphs' device memory back (`ModelRunner.close`)."""
        self.model_runner.close()

    def kv_layout(self) -> dict[str, object]:
        return self.model_runner.kv_layout()

    def _run_model(self, batch: ScheduleBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the batch's sampled rows (None: none is sampled) and, after a decode-graph
        replay, their argmax."""
        runner = self.model_runner
        assert batch.out_cache_loc is not None, "prepare the batch first"
        if batch.is_decode:
            ids = batch.input_ids_device if batch.input_ids_device is not None else batch.input_ids
            logits = runner.forward_decode(ids, batch.positions, batch.req_pool_indices,
                                           batch.out_cache_loc)
            return logits, runner.last_greedy_ids
        logits = runner.forward_extend(batch.input_ids, batch.positions, batch.req_pool_indices,
                                       batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
                                       batch.score)
        rows = batch.sample_rows
        if rows is not None:
            if not rows:  # every request is mid-prompt: nothing to sample
                return None, None
            logits = logits[rows]
        return logits, None

    def forward(self, batch: ScheduleBatch) -> SampleOutput:
        logits, greedy_ids = self._run_model(batch)
        if logits is None:
            out = SampleOutput([], None, None)
        else:
            out = self.sample(logits, batch.sampling, greedy_ids)
        if batch.score is not None:
            out.input_logprobs = batch.score.to_host()
        return out

    def forward_launch(self, batch: ScheduleBatch) -> SampleFuture:
        """Queue the forward and the sampling on the device and start copying the tokens to pinned
        host memory; nothing here waits for the device."""
        logits, greedy_ids = self._run_model(batch)
        if logits is None:
            return SampleFuture(output=SampleOutput([], None, None))
        try:
            sample = self.sampler.sample(logits, batch.sampling, greedy_ids)
        except Exception:  # noqa: BLE001 - find the failing row(s) on the synchronous path
            return SampleFuture(output=self.sample(logits, batch.sampling, greedy_ids))
        sample.copy_to_host()
        return SampleFuture(sample)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               greedy_ids: torch.Tensor | None = None) -> SampleOutput:
        """Sample the batch; if that raises, sample row by row, so a request whose sampling setup
        fails (parameters that got past validation) is the only one to fail: its row is listed in
        `failed` with the error (a batch of one, or of argmax-only rows, raises as is)."""
        try:
            return self.sampler(logits, info, greedy_ids)
        except Exception:  # find the row(s) at fault below
            if info.size <= 1:
                raise
        logger.warning("sampling a batch of %d failed; sampling its rows one by one", info.size)
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[float, int]]] = []
        failed: dict[int, str] = {}
        for i in range(info.size):
            try:
                row = self.sampler(logits[i : i + 1], info.row(i),
                                   None if greedy_ids is None else greedy_ids[i : i + 1])
            except Exception as e:  # this row's own failure
                logger.exception("sampling failed for row %d", i)
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
                ids.append(-1)
                logprobs.append(0.0)
                top.append([])
                continue
            ids.append(row.next_ids[0])
            logprobs.append(row.logprobs[0] if row.logprobs is not None else 0.0)
            top.append(row.top_logprobs[0] if row.top_logprobs is not None else [])
        return SampleOutput(ids, logprobs, top, failed)

    def device_info(self) -> dict[str, str]:
        runner = self.model_runner
        return {"device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", "")}

