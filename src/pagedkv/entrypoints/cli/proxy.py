"""``pagedkv proxy``: the command of the prefill/decode proxy (its app is
`pagedkv.entrypoints.proxy.create_proxy_app`, its protocol described there).

    pagedkv serve --port 8100 ...            # prefill instance(s)
    pagedkv serve --port 8200 ...            # decode instance(s)
    pagedkv proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

# Heavy imports (fastapi, httpx, uvicorn) live inside `run`, so ``pagedkv --help`` stays fast.

import argparse
import logging
import sys
from typing import Any

DESCRIPTION = """\
Prefill/decode disaggregation front end (vLLM's design): OpenAI's API in and out. Each
completion or chat request is prefilled on a --prefill instance (max_tokens 1, kv_transfer_params
{"do_remote_decode": true, ...}); the kv_transfer_params it returns go with the original request
to a --decode instance, whose answer (streamed or not) goes back to the client unchanged.

Instances of a role are used round-robin. A failing instance (connection error, timeout, 5xx) is
skipped for --cooldown seconds and the request retried on the next one; if every prefill
instance fails the decode instance computes the prompt itself; if every decode instance keeps
failing for --retry-window seconds (rounds 0.5 s apart) the client gets 503. A stream cut
mid-answer is continued on another instance from the tokens already sent. 4xx answers are
returned as they are. /health is 200 while a decode
instance is healthy; /v1/models comes from a decode instance. Prints "pagedkv proxy: listening
on http://HOST:PORT" once it accepts connections (--port 0 picks a free port).
"""

EXAMPLES = """\
examples:
  pagedkv proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
  pagedkv proxy --prefill http://p1:8000 http://p2:8000 --decode http://d1:8000 http://d2:8000
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "proxy",
        help="prefill/decode disaggregation front end",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill instances (http://host:port), used round-robin",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode instances (http://host:port), used round-robin",
    )
    p.add_argument(
        "--encoder",
        nargs="+",
        default=None,
        metavar="URL",
        help="encoder instances (EPD: ec_role ec_producer) that encode chat requests' images "
        "before prefill, used round-robin",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--cooldown",
        metavar="SECONDS",
        type=float,
        default=5.0,
        help="how long a failed instance is skipped (default 5)",
    )
    p.add_argument(
        "--retry-window",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="how long a request keeps retrying (rounds 0.5 s apart) while every instance "
        "it could go to fails, e.g. restarting (default 30)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=600.0,
        help="longest wait for an instance's next bytes (default 600)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level; debug logs which instances served each request (default warning)",
    )
    p.set_defaults(func=run)
    return p


def _check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"invalid instance URL {url!r}: use http://host:port")
    return url


def run(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.cli.serve import bind_socket, fail, serve_on_socket
    from pagedkv.entrypoints.proxy import create_proxy_app

    if not 0 <= args.port <= 65535:
        return fail("proxy", ValueError(f"invalid --port {args.port}"))
    if not args.cooldown >= 0 or not args.timeout > 0 or not args.retry_window >= 0:
        return fail(
            "proxy", ValueError("--cooldown and --retry-window must be >= 0 and --timeout > 0")
        )
    try:
        prefill = [_check_url(u) for u in args.prefill]
        decode = [_check_url(u) for u in args.decode]
        encoder = [_check_url(u) for u in args.encoder or []]
    except ValueError as e:
        return fail("proxy", e)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return fail("proxy", OSError(f"cannot bind {args.host}:{args.port}: {e.strerror or e}"))
    app = create_proxy_app(
        prefill, decode, args.cooldown, args.timeout, args.retry_window, encoder or None
    )
    stages = f"encoder {' '.join(encoder)}; " if encoder else ""
    print(
        f"pagedkv proxy: {stages}prefill {' '.join(prefill)}; decode {' '.join(decode)}", flush=True
    )
    return serve_on_socket(app, sock, "proxy", args.log_level)


if __name__ == "__main__":  # python -m pagedkv.entrypoints.cli.proxy ...
    parser = argparse.ArgumentParser(prog="pagedkv")
    parser_sub = parser.add_subparsers(dest="command")
    add_parser(parser_sub)
    sys.exit(run(parser.parse_args(["proxy", *sys.argv[1:]])))
