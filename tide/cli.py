"""Command line: `tide generate`, `tide serve`, `tide memory-plot`.

Engine options take their help text and default from `tide.config.EngineConfig` (one source of truth);
every option's help shows its default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from tide.config import GRAMMAR_BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, option_help
from tide.diffusion import cli as diffusion_cli
from tide.diffusion.config import is_diffusion_model
from tide.server.function_call_parser import TOOL_CALL_PARSERS
from tide.server.reasoning_parser import REASONING_PARSERS
from tide.version import __version__


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default; flags
    (store_true) are off by default and say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.nargs == 0
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def _engine_help(field: str) -> str:
    """EngineConfig's help for `field`, with EngineConfig's default when the text does not name it."""
    text = option_help(field)
    if "default" in text:
        return text
    default = EngineConfig.__dataclass_fields__[field].default
    if isinstance(default, bool):
        return text
    return f"{text} (default: {default})"


def _engine_option(p: Any, field: str, **kwargs: Any) -> None:
    """`--FIELD` for EngineConfig field `field`: default None, so EngineConfig's default applies."""
    p.add_argument("--" + field.replace("_", "-"), dest=field, default=None,
                   help=_engine_help(field), **kwargs)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="model_path", default=None,
                   help="Hugging Face model directory, or a diffusers pipeline directory "
                        "(model_index.json) or demo-diffusion for images (default: the built-in "
                        "demo LLM)")
    _engine_option(p, "device")
    _engine_option(p, "dtype", choices=["auto", "float32", "bfloat16", "float16"])
    _engine_option(p, "max_total_tokens", type=int, metavar="N")
    _engine_option(p, "context_length", type=int, metavar="N")
    _engine_option(p, "chunked_prefill_size", type=int, metavar="N")
    _engine_option(p, "tp_size", type=int, metavar="N")
    _engine_option(p, "disable_custom_all_reduce", action="store_true")
    _engine_option(p, "disable_radix_cache", action="store_true")
    _engine_option(p, "disable_overlap_schedule", action="store_true")
    _engine_option(p, "enable_mixed_chunk", action="store_true")
    _engine_option(p, "grammar_backend", choices=list(GRAMMAR_BACKENDS))
    _engine_option(p, "attention_backend", choices=["auto", "triton", "torch_native"])
    _engine_option(p, "enable_deterministic_inference", action="store_true")
    _engine_option(p, "kv_cache_dtype", choices=list(KV_CACHE_DTYPES))
    _engine_option(p, "quantization", choices=list(QUANTIZATIONS))
    _engine_option(p, "load_format", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--log-level", default=None, type=str.lower,
                   choices=["debug", "info", "warning", "error"],
                   help="log level (default: info for serve, warning for generate)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("model_path", "device", "dtype", "max_total_tokens", "context_length",
            "chunked_prefill_size", "tp_size", "disable_custom_all_reduce", "disable_radix_cache",
            "disable_overlap_schedule",
            "enable_mixed_chunk", "grammar_backend", "attention_backend", "load_format",
            "enable_deterministic_inference", "kv_cache_dtype", "quantization", "log_level")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _cmd_generate(args: argparse.Namespace) -> int:
    if is_diffusion_model(args.model_path):
        return diffusion_cli.generate(args)
    from tide import Engine

    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }
    with Engine(**engine_kwargs(args)) as engine:
        prompt: str = args.prompt
        if args.chat:
            if engine.tokenizer is None:
                raise SystemExit("tide: error: --chat needs a tokenizer and this model has none")
            text = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            assert isinstance(text, str)  # tokenize=False renders text
            prompt = text
        out = engine.generate(prompt=prompt, sampling_params=params)
    assert isinstance(out, dict)  # one prompt: one output
    # A completion continues the prompt, so both are printed; a chat reply stands alone.
    sys.stdout.write((out["text"] if args.chat else args.prompt + out["text"]) + "\n")
    meta = out["meta_info"]
    sys.stderr.write(
        f"[{meta['completion_tokens']} tokens, finish_reason={meta['finish_reason']['type']}, "
        f"{meta['e2e_latency']:.2f}s]\n"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from tide.server.port import check_port_available

    check_port_available(args.host, args.port)  # before the model loads: a busy port fails at once
    if is_diffusion_model(args.model_path):
        return diffusion_cli.serve(args)
    from tide.config import EngineConfig
    from tide.server import ServerArgs, launch_server
    from tide.server.limits import RequestLimits

    kwargs = engine_kwargs(args)
    for key in ("max_running_requests", "mem_fraction_static", "swa_full_tokens_ratio",
                "tokenizer_path",
                "skip_tokenizer_init", "enable_memory_saver", "enable_cpu_backup"):
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    log_level = kwargs.pop("log_level", None) or "info"
    limit_keys = ("max_request_body_bytes", "max_weight_update_body_bytes", "body_read_timeout",
                  "header_read_timeout",
                  "prompt_chars_per_token", "max_batch_size", "max_logprob_entries",
                  "tokenizer_threads")
    limits = RequestLimits(**{k: getattr(args, k) for k in limit_keys
                              if getattr(args, k, None) is not None})
    server_args = ServerArgs(
        engine=EngineConfig.from_kwargs(**kwargs, log_level=log_level),
        host=args.host,
        port=args.port,
        api_key=",".join(args.api_key) if args.api_key else None,
        admin_api_key=args.admin_api_key,
        served_model_name=args.served_model_name,
        log_level=log_level,
        allowed_weight_roots=tuple(args.allowed_weight_roots) if args.allowed_weight_roots else None,
        weight_version=args.weight_version,
        limits=limits,
        allow_unauthenticated_admin=args.allow_unauthenticated_admin,
        incremental_streaming_output=args.incremental_streaming_output,
        scheduler_health_timeout=args.scheduler_health_timeout,
        scheduler_abort_timeout=args.scheduler_abort_timeout,
        startup_timeout=args.startup_timeout,
        dp_size=args.dp_size,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_hosts=tuple(args.allowed_hosts or ()),
    )
    return launch_server(server_args)


def _cmd_memory_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("tide memory-plot needs matplotlib: pip install 'tide[plot]'") from None
    from tide.memory.timeline import plot_timeline

    out = args.output or (args.timeline.rsplit(".", 1)[0] if args.timeline.endswith(".json")
                          else args.timeline) + ".png"
    try:
        plot = plot_timeline(args.timeline, out, title=args.title, max_labels=args.max_labels,
                             start=args.start, end=args.end, dpi=args.dpi)
    except OSError as e:
        raise ValueError(str(e)) from None
    sys.stderr.write(f"wrote {out}: {plot.num_events} events, {plot.num_labelled} labelled\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tide", description=__doc__.split("\n\n")[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tide {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)

    gen = command("generate", "generate a completion (or with --chat a reply) for one prompt")
    gen.add_argument("prompt", help="the prompt text (for images: what to draw)")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                     help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling probability mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the K likeliest (-1: all)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (for images: noise seed)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template and print only the reply")
    _add_engine_args(gen)
    diffusion_cli.add_generate_args(gen)
    gen.set_defaults(func=_cmd_generate)
    srv = command("serve", "serve the OpenAI and sglang-native HTTP API")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (0.0.0.0: every interface; then admin routes need "
                          "--admin-api-key)")
    srv.add_argument("--port", type=int, default=30000,
                     help="port to listen on; checked before the model loads")
    srv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route; give it several times "
                          "(or KEY1,KEY2) for several users: each key is its own identity, and "
                          "request ids (rids) are scoped to it (default: none, no key needed)")
    srv.add_argument("--admin-api-key", default=None,
                     help="require this key on admin routes (flush_cache, abort_all, weight updates, "
                          "pause/continue, ...) (default: none: admin routes only on a loopback --host)")
    srv.add_argument("--incremental-streaming-output", action="store_true",
                     help="each /generate stream event carries only what the sequence added since "
                          "the last one (new text, output ids, logprobs), not all of it so far")
    srv.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                     help="parse tool calls out of chat completions with `tools` in this model "
                          "family's format; they come back as message.tool_calls (default: none: "
                          "chat requests with tools are refused unless tool_choice is 'none')")
    srv.add_argument("--reasoning-parser", default=None, choices=tuple(REASONING_PARSERS),
                     help="move a reasoning model's <think>...</think> out of chat content into "
                          "message.reasoning_content (default: none: left in content)")
    srv.add_argument("--allow-unauthenticated-admin", action="store_true",
                     help="serve the admin routes without --admin-api-key on a --host that is not "
                          "loopback (refused by default)")
    srv.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                     help="on a loopback --host, also answer requests whose Host header names "
                          "NAME (a reverse proxy that forwards the client's Host); others get 403 "
                          "(DNS rebinding) (default: none: localhost and loopback IPs only)")
    srv.add_argument("--allowed-weight-roots", nargs="+", default=None, metavar="DIR",
                     help="directories /update_weights_from_disk may read under (symlinks and .. "
                          "are resolved first; default: the model directory's parent)")
    srv.add_argument("--weight-version", default="default",
                     help="the weight version reported before the first update (default: default)")
    srv.add_argument("--scheduler-health-timeout", type=float, default=30.0, metavar="S",
                     help="/health is 503 and new requests are refused once the scheduler has "
                          "neither stepped nor answered for S seconds (default: 30)")
    srv.add_argument("--scheduler-abort-timeout", type=float, default=120.0, metavar="S",
                     help="in-flight requests end with reason abort once the scheduler has not "
                          "responded for S seconds (default: 120)")
    srv.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                     help="give up (exit 2) if the engine (every replica) is not ready within S "
                          "seconds of start (default: 600)")
    srv.add_argument("--dp-size", type=int, default=1, metavar="N",
                     help="data parallel: N engine replicas behind this server, each request on "
                          "the least loaded; each replica gets its own GPU when there are N, else "
                          "all run on CPU; handover routes act on every replica")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send (default: the model path; tide-demo for the demo)")
    limits = srv.add_argument_group("request limits", "bounds on one request's cost (docs/server.md, "
                                    "Limits)")
    limits.add_argument("--max-request-body-bytes", type=int, default=None, metavar="N",
                        help="largest request body on every route but the weight-payload ones "
                             "(default: 8 MiB); larger bodies get 413 before they are read")
    limits.add_argument("--max-weight-update-body-bytes", type=int, default=None, metavar="N",
                        help="largest body of /update_weights_from_tensor and "
                             "/update_weights_from_ipc (default: 1 GiB)")
    limits.add_argument("--body-read-timeout", type=float, default=None, metavar="SECONDS",
                        help="a request body must have arrived this long after the request "
                             "started, else 408 (default: 30)")
    limits.add_argument("--header-read-timeout", type=float, default=None, metavar="SECONDS",
                        help="a request's headers must have arrived this long after its connection "
                             "opened (or its first byte, on a kept-alive connection), else the "
                             "connection is closed (default: 10)")
    limits.add_argument("--prompt-chars-per-token", type=int, default=None, metavar="N",
                        help="text prompts longer than context length x N characters are refused "
                             "before tokenization (default: 32)")
    limits.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                        help="most sequences one request may ask for, prompts x n (default: 4096)")
    limits.add_argument("--max-logprob-entries", type=int, default=None, metavar="N",
                        help="most logprob entries one request may ask for, sequences x max new "
                             "tokens x (1 + top logprobs) (default: 8388608)")
    limits.add_argument("--tokenizer-threads", type=int, default=None, metavar="N",
                        help="threads that tokenize off the event loop (default: 2)")
    _engine_option(srv, "tokenizer_path", metavar="DIR")
    _engine_option(srv, "skip_tokenizer_init", action="store_true")
    _engine_option(srv, "max_running_requests", type=int, metavar="N")
    _engine_option(srv, "mem_fraction_static", type=float, metavar="F")
    _engine_option(srv, "swa_full_tokens_ratio", type=float, metavar="F")
    _engine_option(srv, "enable_memory_saver", action="store_true")
    _engine_option(srv, "enable_cpu_backup", action="store_true")
    _add_engine_args(srv)
    diffusion_cli.add_serve_args(srv)
    srv.set_defaults(func=_cmd_serve)
    plot = command("memory-plot", "draw a memory timeline (Engine.dump_memory_timeline or GET "
                                  "/dump_memory_timeline) as a PNG")
    plot.add_argument("timeline", help="timeline JSON file")
    plot.add_argument("-o", "--output", default=None,
                      help="PNG to write (default: the JSON path with .png)")
    plot.add_argument("--title", default=None, help="plot title (default: none)")
    plot.add_argument("--max-labels", type=int, default=200,
                      help="label at most this many events (those with the largest memory change "
                           "or stall); every event still gets its line (default: 200)")
    plot.add_argument("--start", type=float, default=None,
                      help="first second to show, counted from the first event (default: 0)")
    plot.add_argument("--end", type=float, default=None,
                      help="last second to show, counted from the first event (default: the last event)")
    plot.add_argument("--dpi", type=int, default=100, help="resolution of the PNG")
    plot.set_defaults(func=_cmd_memory_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        parser.exit(2, f"tide: error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
