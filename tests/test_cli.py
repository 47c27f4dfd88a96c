"""The `tide` command line: help text and defaults on every option (read from `EngineConfig` for engine
options), `--version`, usage errors, `generate --chat` output, and `serve` failing fast on a busy port."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tide import cli
from tide.config import EngineConfig
from tide.version import __version__

REPO = Path(__file__).resolve().parent.parent


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("tide has no subcommands")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_engine_config_field_has_help():
    for field in dataclasses.fields(EngineConfig):
        text = field.metadata.get("help")
        assert isinstance(text, str) and len(text) > 10, field.name


def test_every_cli_option_has_help_and_shows_its_default():
    parser = cli.build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"generate", "serve", "memory-plot"}
    for name, sub in commands.items():
        for action in _options(sub):
            flag = action.option_strings[-1]
            assert action.help, f"tide {name} {flag} has no help text"
            if action.nargs == 0:  # a flag: off unless given
                continue
            rendered = sub.formatter_class(prog="tide")._get_help_string(action)
            assert "default" in (rendered or ""), f"tide {name} {flag} does not show its default"
        for action in sub._actions:
            if not action.option_strings:
                assert action.help, f"tide {name} {action.dest} has no help text"


def test_engine_options_reuse_engine_config_help():
    serve = _subparsers(cli.build_parser())["serve"]
    by_dest = {a.dest: a for a in _options(serve)}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    shared = [d for d in by_dest if d in fields and d != "model_path" and d != "log_level"]
    assert len(shared) >= 12
    for dest in shared:
        assert fields[dest].metadata["help"] in by_dest[dest].help, dest
    assert "(default: 0.85)" in by_dest["mem_fraction_static"].help


def test_help_names_only_real_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "bench" not in out
    for name in ("generate", "serve", "memory-plot"):
        assert name in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tide {__version__}"


def test_generate_without_prompt_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--max-new-tokens", "2"])
    assert e.value.code == 2
    assert "prompt" in capsys.readouterr().err


def test_generate_chat_prints_only_the_reply(capsys):
    import tide

    prompt = "Write a loop"
    args = ["--max-new-tokens", "6", "--temperature", "0", "--max-total-tokens", "512"]
    assert cli.main(["generate", "--chat", prompt, *args]) == 0
    chat_out = capsys.readouterr().out
    assert cli.main(["generate", prompt, *args]) == 0
    plain_out = capsys.readouterr().out
    with tide.Engine(max_total_tokens=512) as engine:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                    tokenize=False, add_generation_prompt=True)
        reply = engine.generate(prompt=text, sampling_params={"max_new_tokens": 6,
                                                              "temperature": 0})["text"]
        completion = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 6,
                                                                     "temperature": 0})["text"]
    assert chat_out == reply + "\n"
    assert plain_out == prompt + completion + "\n"  # a completion continues its prompt


def test_serve_takes_a_startup_timeout_and_checks_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tide", "serve", "--startup-timeout", "0"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "startup_timeout must be in [1.0, 86400]" in proc.stderr


def test_serve_rejects_a_port_out_of_range_naming_it(tmp_path):
    from tide.server.port import check_port_available

    with pytest.raises(ValueError, match=r"--port must be in \[0, 65535\], got -1"):
        check_port_available("127.0.0.1", -1)  # not "--host cannot be resolved"


def test_serve_on_a_busy_port_fails_before_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tide", "serve", "--port", str(port),
                               "--log-level", "info"],
                              capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
        elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "loading" not in proc.stderr and "startup complete" not in proc.stderr
    assert elapsed < 30


def test_port_check_passes_on_a_free_port_and_leaves_it_free():
    from tide.server.port import check_port_available

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_available("127.0.0.1", port)
    check_port_available("127.0.0.1", port)  # released: a second check (and uvicorn) can bind
    with pytest.raises(ValueError, match="--host"):
        check_port_available("no-such-host.invalid", port)


def test_long_prompt_tokenizes_without_transformers_length_warning():
    import logging

    from tide.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(EngineConfig())
    assert tokenizer is not None
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    tlog = logging.getLogger("transformers")
    tlog.addHandler(handler)
    try:
        ids = tokenizer.encode("for x in range(10): print(x)\n" * 400)
    finally:
        tlog.removeHandler(handler)
    assert len(ids) > 2048  # longer than the demo tokenizer's configured model_max_length (512)
    assert not [r for r in records if "sequence length is longer" in r.getMessage()]


def test_engine_options_reach_the_engine_and_are_checked():
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--quantization", "fp8",
                              "--kv-cache-dtype", "fp8_e4m3"])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["quantization"] == "fp8" and kwargs["kv_cache_dtype"] == "fp8_e4m3"
    assert "quantization" not in cli.engine_kwargs(parser.parse_args(["generate", "hi"]))
    with pytest.raises(SystemExit):  # argparse names the bad choice
        parser.parse_args(["generate", "hi", "--quantization", "int4"])
