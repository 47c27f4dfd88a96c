"""Messages between the HTTP process (TokenizerManager) and the scheduler process.

Everything on the wire is a `msgspec.Struct` tagged with its class name and encoded with msgpack, so
both sides decode into typed objects (`decode_message`) and an unknown message is an error, not a
silent `dict`. Names follow sglang (`TokenizedGenerateReqInput`, `BatchTokenIDOut`, `AbortReq`, ...).

Control messages (flush, info, load, shutdown, and the admin messages: weight updates, pause/continue,
weight version, memory release/resume, memory timeline) carry a `req_id`; the scheduler answers each
with one `ControlReqOutput` bearing the same `req_id`, so the HTTP side can match replies to callers.
Admin replies put sglang's `num_paused_requests` (and anything else a route returns) in `data`.
The scheduler's heartbeat thread also sends a `SchedulerHeartbeat` every interval (liveness).
"""

from __future__ import annotations

from typing import Any

import msgspec


class TokenizedGenerateReqInput(msgspec.Struct, tag=True):
    """One generation request, already tokenized and validated (n == 1; the HTTP side expands n)."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # input logprobs from this prompt position on (-1: none)


class AbortReq(msgspec.Struct, tag=True):
    """Abort the requests `rids` (or every request with `abort_all`); they are reported finished
    with reason abort. With a `req_id`, the scheduler also replies (`data["num_aborted"]`) after
    those outputs, so the caller knows the aborts have landed."""

    rids: list[str] = []
    abort_all: bool = False
    message: str = "aborted"
    req_id: str | None = None


class FlushCacheReqInput(msgspec.Struct, tag=True):
    """Reset radix cache, request slots and KV allocator once idle, waiting up to `timeout` seconds."""

    req_id: str
    timeout: float = 0.0


class GetLoadReqInput(msgspec.Struct, tag=True):
    """Ask for the scheduler's live counters (queue, running, KV slots, token totals)."""

    req_id: str


class GetServerInfoReqInput(msgspec.Struct, tag=True):
    """Ask for the scheduler's static facts plus its live counters."""

    req_id: str


class ShutdownReq(msgspec.Struct, tag=True):
    """Abort everything, reply, and leave the loop."""

    req_id: str


MAX_WEIGHT_VERSION_CHARS = 256


def check_weight_version(value: object, param: str = "weight_version") -> str:
    """A weight version: 1 to `MAX_WEIGHT_VERSION_CHARS` printable characters (it is reported with
    every output and logged); ValueError naming `param` otherwise."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{param} must be a non-empty string")
    if len(value) > MAX_WEIGHT_VERSION_CHARS or not value.isprintable():
        raise ValueError(f"{param} must be at most {MAX_WEIGHT_VERSION_CHARS} printable characters")
    return value


class WeightUpdateOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The options every weight update takes (sglang's names and defaults), defined once: the update
    messages extend it, the HTTP bodies are built from its fields (`tide.server.protocol`), and
    `Engine.update_weights_*` take them as keyword arguments (`from_kwargs`).

    `flush_cache`: flush the (now stale) KV caches afterwards; `torch_empty_cache`: empty the device
    allocator cache too; `abort_all_requests`: abort in-flight requests instead of waiting for them;
    `weight_version`: the version the new weights carry."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False

    def __post_init__(self) -> None:
        if self.weight_version is not None:
            check_weight_version(self.weight_version)

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> WeightUpdateOptions:
        """Options from keyword arguments; ValueError naming an unknown option or a wrong type."""
        try:
            return msgspec.convert(options, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"weight update options: {e}") from None


WEIGHT_UPDATE_OPTIONS: tuple[str, ...] = WeightUpdateOptions.__struct_fields__


def weight_update_options(obj: Any) -> dict[str, Any]:
    """The `WeightUpdateOptions` fields of `obj` (an HTTP body, say) as keyword arguments."""
    return {name: getattr(obj, name) for name in WEIGHT_UPDATE_OPTIONS}


class UpdateWeightFromDiskReqInput(WeightUpdateOptions, tag=True, frozen=True):
    """Load an HF safetensors directory (already checked against `--allowed-weight-roots`)."""

    req_id: str
    model_path: str
    load_format: str | None = None


class UpdateWeightsFromTensorReqInput(WeightUpdateOptions, tag=True, frozen=True):
    """`serialized_named_tensors` made by `tide.weights.serialize_named_tensors` (one payload)."""

    req_id: str
    serialized_named_tensors: str
    load_format: str | None = None


class UpdateWeightsFromIPCReqInput(WeightUpdateOptions, tag=True, frozen=True):
    """Serialized flattened buckets whose buffers are CUDA IPC handles of a colocated trainer."""

    req_id: str
    serialized_buckets: str


class InitWeightsUpdateGroupReqInput(msgspec.Struct, tag=True):
    """Join the trainer's broadcast group as rank `rank_offset` (the trainer is rank 0)."""

    req_id: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout: float = 120.0  # seconds the join may take before it fails and cleans up


class DestroyWeightsUpdateGroupReqInput(msgspec.Struct, tag=True):
    req_id: str
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(WeightUpdateOptions, tag=True, frozen=True):
    """Receive the tensors rank 0 broadcasts over `group_name`, in `names` order."""

    req_id: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str | None = None


class GetWeightsByNameReqInput(msgspec.Struct, tag=True):
    req_id: str
    name: str
    truncate_size: int = 100


class UpdateWeightVersionReqInput(msgspec.Struct, tag=True):
    req_id: str
    new_version: str
    abort_all_requests: bool = True


class PauseGenerationReqInput(msgspec.Struct, tag=True):
    req_id: str
    mode: str = "abort"


class ContinueGenerationReqInput(msgspec.Struct, tag=True):
    req_id: str
    torch_empty_cache: bool = True


class ReleaseMemoryOccupationReqInput(msgspec.Struct, tag=True):
    """Give back the memory of `tags` (None: all); the engine must be idle or paused."""

    req_id: str
    tags: list[str] | None = None


class ResumeMemoryOccupationReqInput(msgspec.Struct, tag=True):
    """Take the memory of `tags` (None: all) again."""

    req_id: str
    tags: list[str] | None = None


class DumpMemoryTimelineReqInput(msgspec.Struct, tag=True):
    """Reply with the scheduler process's memory timeline (its `MemoryLedger.to_dict()`) in
    `data["timeline"]`."""

    req_id: str


class StartProfileReqInput(msgspec.Struct, tag=True):
    """Start torch.profiler on every rank (`tide.scheduler.profile`); files go to the server's
    profile directory, under `profile_id`."""

    req_id: str
    num_steps: int | None = None
    activities: list[str] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str = ""


class StopProfileReqInput(msgspec.Struct, tag=True):
    """Stop the running profile; `data["paths"]` lists the files every rank wrote."""

    req_id: str


WeightUpdateReq = (
    UpdateWeightFromDiskReqInput
    | UpdateWeightsFromTensorReqInput
    | UpdateWeightsFromIPCReqInput
    | UpdateWeightsFromDistributedReqInput
)


class BatchTokenIDOut(msgspec.Struct, tag=True):
    """Incremental outputs of one scheduler step: for each request that got tokens, the new ids.

    All lists are parallel to `rids`. Logprob lists are empty for requests that did not ask for them;
    `finished_reasons[i]` is None while request i is running. `weight_versions[i]` is the weight
    version the new tokens were generated with (for a finished request, the one it finished with).
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    new_token_logprobs: list[list[float]]
    new_top_logprobs: list[list[list[tuple[float, int]]]]
    finished_reasons: list[dict[str, Any] | None]
    cached_tokens: list[int]
    weight_versions: list[str | None] = []
    # A request's input logprobs (None for prompt position 0) and top logprobs, sent once, in the
    # first output after its prefill; empty lists otherwise (or an empty list for the whole batch).
    input_token_logprobs: list[list[float | None]] = []
    input_top_logprobs: list[list[list[tuple[float, int]] | None]] = []


class ControlReqOutput(msgspec.Struct, tag=True):
    """Reply to a control message."""

    req_id: str
    success: bool
    message: str = ""
    data: dict[str, Any] = {}


class SchedulerHeartbeat(msgspec.Struct, tag=True):
    """Sent by the scheduler process's heartbeat thread every interval: `loop_count` turns of the
    loop so far, and the long operation the loop has declared (`operation`, running for
    `operation_seconds`), if any. The HTTP side judges liveness from these (`server.liveness`)."""

    loop_count: int
    operation: str | None = None
    operation_seconds: float = 0.0


class SchedulerReady(msgspec.Struct, tag=True):
    """Sent once (over the start-up pipe) when the model is loaded, or with `error` when it failed."""

    error: str | None = None
    info: dict[str, Any] = {}


SchedulerInput = (
    TokenizedGenerateReqInput
    | AbortReq
    | FlushCacheReqInput
    | GetLoadReqInput
    | GetServerInfoReqInput
    | ShutdownReq
    | StartProfileReqInput
    | StopProfileReqInput
    | UpdateWeightFromDiskReqInput
    | UpdateWeightsFromTensorReqInput
    | UpdateWeightsFromIPCReqInput
    | InitWeightsUpdateGroupReqInput
    | DestroyWeightsUpdateGroupReqInput
    | UpdateWeightsFromDistributedReqInput
    | GetWeightsByNameReqInput
    | UpdateWeightVersionReqInput
    | PauseGenerationReqInput
    | ContinueGenerationReqInput
    | ReleaseMemoryOccupationReqInput
    | ResumeMemoryOccupationReqInput
    | DumpMemoryTimelineReqInput
)
SchedulerOutput = BatchTokenIDOut | ControlReqOutput | SchedulerHeartbeat

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(SchedulerInput)
_output_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def encode_message(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> SchedulerInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> SchedulerOutput:
    return _output_decoder.decode(data)


# sglang's generate arguments for what tide does not serve (images, LoRA, hidden states, sessions,
# custom logit processors, disaggregation, priorities): taken at the defaults its clients pass when
# they do not use them, else a ValueError naming the argument (a 400 over HTTP).
UNUSED_ARGS: dict[str, bool | None] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "modalities": None, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "return_hidden_states": False, "return_routed_experts": False, "token_ids_logprob": None,
    "session_params": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "data_parallel_rank": None, "priority": None,
}
# `Engine.generate` / `async_generate` also take sglang's `stream` (tide's in-process calls return
# whole outputs; the HTTP server streams).
ENGINE_UNUSED_ARGS: dict[str, bool | None] = {**UNUSED_ARGS, "stream": False}


def unsupported(name: str, default: bool | None) -> str:
    """The error of an unused argument given another value than its default."""
    shown = "None/null" if default is None else "False/false"
    return f"{name} is not supported by tide; leave it out or pass {shown}"


def check_unused_args(args: dict[str, Any], table: dict[str, bool | None]) -> None:
    """TypeError for a name not in `table` (as for any unknown keyword argument); ValueError
    naming an argument given another value than its default."""
    for name, value in args.items():
        if name not in table:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        if value is not table[name]:
            raise ValueError(unsupported(name, table[name]))
