"""`launch_server`: start the scheduler process, then serve HTTP until a signal, then clean up.

Process layout:

    tide serve (HTTP process: uvicorn + FastAPI + TokenizerManager)
      └── scheduler process (spawned): Engine (model runner + scheduler), zmq PULL/PUSH
          (with --dp-size N: a data-parallel controller speaking the same protocol, routing over N
          scheduler processes, see `tide.cluster.dp_controller`)

Shutdown (SIGINT/SIGTERM): every in-flight request is finished with an abort right away (streams end
with finish_reason abort), uvicorn closes connections, the lifespan asks the scheduler to abort and
exit, and the launcher joins it (terminate, then kill, if it does not go). If this process dies hard,
the scheduler gets SIGTERM from the kernel (PR_SET_PDEATHSIG) or notices the parent is gone, and
removes the `ipc://` socket directory on its way out (this process removes it too on a normal exit).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from types import FrameType
from typing import Any

import msgspec
import uvicorn

from tide.io_struct import SchedulerReady
from tide.server.connection import header_deadline_protocol
from tide.server.metrics import ServerMetrics
from tide.server.server_args import ServerArgs

logger = logging.getLogger("tide.server")


class StartupError(RuntimeError):
    """The scheduler process could not load the model (message says why)."""


class _Server(uvicorn.Server):
    """uvicorn server whose first exit signal also aborts in-flight requests, so open streams end
    now instead of holding the graceful shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, tm: Any) -> None:
        super().__init__(config)
        self.tm = tm

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("received %s: aborting %d in-flight requests and shutting down",
                        signal.Signals(sig).name, len(self.tm.rid_to_state))
            self.tm.shutting_down = True
            # Run the abort as a loop callback, not inside whatever code the signal interrupted.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.tm.abort_all_local("server shutting down")
            else:
                loop.call_soon_threadsafe(self.tm.abort_all_local, "server shutting down")
        super().handle_exit(sig, frame)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("tide").setLevel(level.upper())


def launch_server(args: ServerArgs) -> int:
    """Run `tide serve` in this process; returns the exit code."""
    from tide.scheduler.process import run_scheduler_process
    from tide.server.http_server import create_app
    from tide.server.tokenizer_manager import ModelInfo, TokenizerManager
    from tide.tokenizer import load_tokenizer

    setup_logging(args.log_level)
    warning = args.open_admin_warning()
    if warning is not None:
        logger.warning("%s", warning)
    ipc_dir = tempfile.mkdtemp(prefix="tide-ipc-")
    input_addr = f"ipc://{os.path.join(ipc_dir, 'scheduler_input')}"
    output_addr = f"ipc://{os.path.join(ipc_dir, 'scheduler_output')}"
    ctx = mp.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    engine_config = args.engine.replace(log_level=args.log_level)
    kwargs: dict[str, Any] = {"heartbeat_interval": min(1.0, args.scheduler_health_timeout / 4),
                              "ipc_dir": ipc_dir}
    target: Any = run_scheduler_process
    if args.dp_size > 1:
        # Looks like one scheduler process to this side; starts and routes over the replicas.
        from tide.cluster.dp_controller import run_dp_controller_process

        target = run_dp_controller_process
        kwargs.update(dp_size=args.dp_size, startup_timeout=args.startup_timeout,
                      replica_stall_timeout=args.scheduler_abort_timeout)
    proc = ctx.Process(
        target=target,
        args=(engine_config, input_addr, output_addr, os.getpid(), ready_send, args.weight_version),
        kwargs=kwargs,
        name="tide-scheduler" if args.dp_size == 1 else "tide-dp-controller",
        daemon=args.dp_size == 1,  # a daemonic process may not start the replicas' processes
    )
    previous_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        proc.start()
        ready_send.close()
        logger.info("loading %s (scheduler pid %d)", args.engine.model_path, proc.pid)
        tokenizer = load_tokenizer(args.engine)
        info = _wait_ready(ready_recv, proc, args.startup_timeout)
        model_info = ModelInfo.from_ready(info)
        metrics = ServerMetrics(args.model_names[0])
        tm = TokenizerManager(tokenizer, model_info, input_addr, output_addr, metrics,
                              scheduler_alive=proc.is_alive, limits=args.limits,
                              health_timeout=args.scheduler_health_timeout,
                              abort_timeout=args.scheduler_abort_timeout)
        app = create_app(args, tm, metrics)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(),
            access_log=args.log_level.lower() == "debug", timeout_graceful_shutdown=10,
            timeout_keep_alive=5, lifespan="on", log_config=None,  # one log format for all
            http=header_deadline_protocol(args.limits.header_read_timeout),
        )
        server = _Server(config, tm)
        tm.on_fatal = lambda: setattr(server, "should_exit", True)
        # uvicorn handles SIGINT/SIGTERM while it runs and re-raises the signal once it has shut
        # down; a no-op handler then lets this function clean up and return normally.
        signal.signal(signal.SIGTERM, _ignore_signal)
        previous_int = signal.signal(signal.SIGINT, _ignore_signal)
        try:
            server.run()
        finally:
            signal.signal(signal.SIGINT, previous_int)
        if tm.dead:
            return 1
        return 0 if server.started else 1
    except StartupError as e:
        logger.error("%s", e)
        sys.stderr.write(f"tide: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        # A data-parallel controller first waits (up to 5 s) for its replicas to exit.
        _stop_process(proc, timeout=5.0 if args.dp_size == 1 else 10.0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    pass


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _wait_ready(conn: Any, proc: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.5):
            try:
                msg = msgspec.msgpack.decode(conn.recv_bytes(), type=SchedulerReady)
            except EOFError:
                break
            if msg.error is not None:
                raise StartupError(msg.error)
            return dict(msg.info)
        if not proc.is_alive():
            break
    if proc.is_alive():
        raise StartupError(f"the scheduler process did not get ready within {timeout:.0f} s")
    raise StartupError(f"the scheduler process exited during start-up (exit code {proc.exitcode})")


def _stop_process(proc: Any, timeout: float = 5.0) -> None:
    if proc.pid is None:
        return
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("scheduler process did not exit; terminating it")
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)
