"""``pagedkv serve``: the OpenAI-compatible HTTP server (see openai/api_server.py).

    pagedkv serve --port 8000                       # SmolLM2-135M-Instruct on 127.0.0.1:8000
    pagedkv serve --num-kv-blocks 512 --max-num-seqs 64 --enable-kv-cache-events \\
        --kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``, ``POST /reset_prefix_cache``, ``/dashboard``. The server prints one line
``pagedkv serve: listening on http://HOST:PORT`` once it accepts connections (``--port 0``
picks a free port; the line has the real one), and with KV events ``pagedkv serve: kv events
on ENDPOINT (replay ENDPOINT)``. Invalid options exit with code 2 before the model loads.

`BackgroundServer` runs an app in a thread of the current process (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
from typing import Any

from pagedkv import envs

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Serve the model over HTTP with OpenAI's API: /v1/completions and /v1/chat/completions
(streaming or not), /v1/models, plus /health, /metrics (Prometheus), POST /reset_prefix_cache
and a live KV cache dashboard at /dashboard. The official openai client works against it.

At start it prints the KV cache plan on standard error and, once it accepts connections, the
line "pagedkv serve: listening on http://HOST:PORT" (--port 0 picks a free port; the line has
the real one). It refuses to start, with a one-line message and exit code 2, on invalid options
or when one request of --max-model-len tokens cannot fit in the KV cache.
"""

EXAMPLES = """\
examples:
  pagedkv serve --port 8000
  pagedkv serve --max-model-len 4096 --kv-cache-memory 512MiB --max-num-seqs 64
  pagedkv serve --enable-kv-cache-events --kv-events-replay-endpoint tcp://127.0.0.1:5558
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedkv.engine.arg_utils import KV_EVENTS_ARGS, SCHEDULER_ARGS, EngineArgs, size_arg
    from pagedkv.entrypoints.cli.generate import add_engine_args

    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: derived from --model)",
    )
    p.add_argument(
        "--max-queue-size",
        type=int,
        default=256,
        help="requests allowed to wait beyond --max-num-seqs; more get 503 (default 256)",
    )
    p.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="answer GET /tokenizer_info (special tokens and chat template; off by default, "
        "as in vLLM): lm-eval's remote tokenizer needs it",
    )
    p.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        default=None,
        help="chat image_url parts may name files under DIR (default: data: URLs only; "
        "nothing is ever fetched)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level; info logs one access line per request (default warning)",
    )
    o = p.add_argument_group("metrics and stats")
    o.add_argument(
        "--metrics-prefix",
        default="pagedkv",
        choices=["pagedkv", "vllm"],
        help="name prefix of the /metrics series; 'vllm' exports vLLM's exact names, so "
        "dashboards made for vLLM work (default pagedkv)",
    )
    o.add_argument(
        "--log-stats-interval",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="log a throughput / queue / KV usage line this often while busy; 0 turns "
        "it off (default 10)",
    )
    s = p.add_argument_group("security")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        default=envs.PAGEDKV_API_KEY,
        help="require 'Authorization: Bearer KEY' on /v1/* and /reset_prefix_cache "
        "(default: the PAGEDKV_API_KEY environment variable; /health, /metrics "
        "and the read-only dashboard stay open)",
    )
    s.add_argument(
        "--max-request-bytes",
        metavar="SIZE",
        type=size_arg,
        default=8 * 2**20,
        help="largest request body accepted, e.g. 8MiB; larger ones get 413 (default 8MiB)",
    )
    EngineArgs.add_cli_args(add_engine_args(p), include=SCHEDULER_ARGS)
    e = p.add_argument_group("KV events (vLLM's ZMQ wire format)")
    EngineArgs.add_cli_args(e, include=KV_EVENTS_ARGS)
    e.add_argument(
        "--kv-events-endpoint",
        default="tcp://127.0.0.1:5557",
        help="PUB endpoint to bind (default tcp://127.0.0.1:5557; port 0 = free port)",
    )
    e.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ROUTER endpoint to bind for replays (default: no replay)",
    )
    e.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        default=10_000,
        help="batches kept for replay (default 10000)",
    )
    e.add_argument(
        "--kv-events-topic", default="", help="topic frame of every message (default empty)"
    )
    p.set_defaults(func=run)
    return p


def engine_config(args: argparse.Namespace) -> Any:
    """`EngineConfig` from the flags; raises ValueError (a `CLIError` for
    ``--kv-transfer-config``) naming the bad one."""
    from pagedkv.entrypoints.cli.generate import engine_args

    return engine_args(args).create_engine_config()


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=2,
        # The app logs each request itself, with its duration.
        access_log=False,
        timeout_keep_alive=30,
    )
    return uvicorn.Server(config)


def serve_on_socket(app: Any, sock: socket.socket, prog: str, log_level: str) -> int:
    """Print ``pagedkv PROG: listening on http://HOST:PORT`` and serve ``app`` on the bound
    ``sock`` until interrupted (the socket closed after); returns exit code 0."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"pagedkv {prog}: listening on http://{shown}:{port}", flush=True)
    server = _uvicorn_server(app, log_level)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


def fail(prog: str, err: Exception) -> int:
    print(f"pagedkv {prog}: error: {err}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.openai.api_server import KVEventsOptions, create_app

    if args.max_queue_size < 0:
        return fail(
            "serve", ValueError(f"invalid --max-queue-size {args.max_queue_size}: must be >= 0")
        )
    if not 0 <= args.port <= 65535:
        return fail("serve", ValueError(f"invalid --port {args.port}"))
    if args.api_key is not None and not args.api_key.strip():
        return fail("serve", ValueError("invalid --api-key: must not be empty"))
    if not args.log_stats_interval >= 0:
        return fail(
            "serve",
            ValueError(f"invalid --log-stats-interval {args.log_stats_interval}: must be >= 0"),
        )
    if args.max_request_bytes < 1:
        return fail(
            "serve",
            ValueError(f"invalid --max-request-bytes {args.max_request_bytes}: must be >= 1"),
        )
    from pagedkv.entrypoints.cli.common import CLIError

    try:
        config = engine_config(args)
    except (ValueError, CLIError) as e:
        return fail("serve", e)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return fail("serve", OSError(f"cannot bind {args.host}:{args.port}: {e.strerror or e}"))
    kv_events = None
    if args.enable_kv_cache_events:
        kv_events = KVEventsOptions(
            args.kv_events_endpoint,
            args.kv_events_replay_endpoint,
            args.kv_events_buffer_steps,
            args.kv_events_topic,
        )
    from pagedkv.entrypoints.cli.generate import (
        CLIError,
        loading_progress,
        preflight,
        print_kv_summary,
    )

    try:
        model_config = preflight(config)  # bad model, KV cache too small: fail before loading
    except CLIError as e:
        sock.close()
        return fail("serve", e)
    try:
        with loading_progress("serve", f"model {model_config.name}"):
            app = create_app(
                config,
                served_model_name=args.served_model_name,
                api_key=args.api_key,
                max_request_bytes=args.max_request_bytes,
                max_queue_size=args.max_queue_size,
                kv_events=kv_events,
                enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                allowed_local_media_path=args.allowed_local_media_path,
            )
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        sock.close()
        return fail("serve", e)
    except Exception as e:
        sock.close()
        return fail("serve", RuntimeError(f"cannot start: {e}"))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    state = app.state.pagedkv
    from pagedkv.entrypoints.stat_logger import configure_server_stats

    configure_server_stats(state, args.metrics_prefix, args.log_stats_interval)
    pub = state.kv_event_publisher
    if pub is not None:
        replay = f" (replay {pub.replay_endpoint})" if pub.replay_endpoint else ""
        print(f"pagedkv serve: kv events on {pub.endpoint}{replay}", flush=True)
    print_kv_summary("serve", state.async_llm.engine)
    print(
        f"pagedkv serve: model {state.served_model_name}, "
        f"{state.async_llm.engine.kv_cache_config.num_blocks} KV blocks",
        flush=True,
    )
    if args.api_key is not None:
        print("pagedkv serve: API key required on /v1/* and /reset_prefix_cache", flush=True)
    print(f"pagedkv serve: listening on http://{shown}:{port}", flush=True)
    server = _uvicorn_server(app, args.log_level)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        state.async_llm.shutdown()
    return 0


class BackgroundServer:
    """Serve ``app`` on ``host:port`` (0: a free port) from a daemon thread of this process.

    ``with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")``. ``stop()`` shuts
    uvicorn down, which runs the app's lifespan shutdown (the engine loop stops with it).
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.app = app
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = _uvicorn_server(app, log_level)
        self._thread = threading.Thread(target=self._serve, name="pagedkv-http", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:
            self._error = e

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start in time")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":  # python -m pagedkv.entrypoints.cli.serve ...
    parser = argparse.ArgumentParser(prog="pagedkv")
    add_parser(parser.add_subparsers(dest="command"))
    sys.exit(run(parser.parse_args(["serve", *sys.argv[1:]])))
