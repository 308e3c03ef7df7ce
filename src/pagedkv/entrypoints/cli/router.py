"""``pagedkv router``: a KV-aware front end over several ``pagedkv serve`` replicas (the
machinery is in `pagedkv.router`; this module is the command).

    pagedkv serve --port 8001 --enable-kv-cache-events --kv-events-endpoint tcp://127.0.0.1:0 \\
        --kv-events-replay-endpoint tcp://127.0.0.1:0        # and 8002, 8003 ...
    pagedkv router --replica http://127.0.0.1:8001 http://127.0.0.1:8002 http://127.0.0.1:8003 --port 8000
"""

# Heavy imports (fastapi, httpx, the tokenizer) live inside `run`, so ``pagedkv --help`` stays fast.

import argparse
import logging
import sys
from typing import Any

DESCRIPTION = """\
KV-aware router over pagedkv and vLLM replicas (vLLM-router / Dynamo style): OpenAI's API in and out
(streams passed through). It mirrors every replica's prefix cache from its KV events (ZMQ
PUB + replay on connect and after a sequence gap) in one index of block hash -> replicas, and
sends each request to the replica with the lowest cost

    overlap-weight * (prompt blocks not cached there) + load-weight * (its active blocks
    + waiting requests' blocks + this prompt's blocks)

(--policy kv; tier-held blocks count --tier-credit of a device block), or by load, or
round-robin. The prompt is tokenized and hashed exactly as the replicas do: block size, hash
algorithm and seed, model and tokenizer are read from each replica's GET /v1/kv_cache_config
(a vLLM server has none: its block size and hash algorithm come from the labels of
vllm:cache_config_info on its /metrics, its model from /v1/models, and the hash seed, event
endpoints and tokenizer from --hash-seed, --replica URL,events=...,replay=... and --tokenizer),
and a replica that differs from the first is refused (exit code 2 at start; kept out of rotation
if it comes back different later).

Replicas must run with --enable-kv-cache-events (and --kv-events-replay-endpoint: without it a
lost event batch can only be forgotten). A replica that stops answering is taken out and its
requests retried on the next choice; when it answers again it is re-indexed from its replay
socket. With --decode the replicas are a prefill pool: the KV score picks the prefill instance
and the decode pool is used round-robin (pagedkv proxy's protocol).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics (decisions by
reason, index size, predicted vs reported cached tokens, event lag) and /router/state (JSON).
Each answer carries x-pagedkv-replica, x-pagedkv-route-reason and
x-pagedkv-predicted-cached-tokens headers. Prints "pagedkv router: listening on
http://HOST:PORT" once it accepts connections (--port 0 picks a free port).
"""

EXAMPLES = """\
examples:
  pagedkv router --replica http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8000
  pagedkv router --replica http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558 ...
  pagedkv router --policy round-robin --replica http://127.0.0.1:8001 http://127.0.0.1:8002
  pagedkv router --replica http://p1:8000 http://p2:8000 --decode http://d1:8000 --port 8000
  PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server --model DIR --port 8001 \
      --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                           "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
  pagedkv router --hash-seed 0 --tokenizer DIR \
      --replica http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.router.scoring import POLICIES, RoutingWeights

    w = RoutingWeights()
    p = subparsers.add_parser(
        "router",
        help="KV-aware router over several servers",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--replica",
        "--prefill",
        dest="replica",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL[,events=tcp://H:P][,replay=tcp://H:P]",
        help="replicas (repeatable); with --decode, the prefill pool. events=/replay= "
        "override the KV event endpoints the replica reports",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=None,
        metavar="URL",
        help="decode instances: prefill/decode pools (see above)",
    )
    p.add_argument("--policy", choices=POLICIES, default="kv", help="routing policy (default kv)")
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=w.overlap,
        metavar="W",
        help=f"weight of the blocks to prefill (Dynamo's overlap_score_weight; default {w.overlap:g})",
    )
    p.add_argument(
        "--load-weight",
        type=float,
        default=w.load,
        metavar="W",
        help=f"weight of the load term (default {w.load:g})",
    )
    p.add_argument(
        "--tier-credit",
        type=float,
        default=w.tier_credit,
        metavar="C",
        help=f"what a block held only in an offload tier is worth, 0..1 (default {w.tier_credit:g})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=w.temperature,
        metavar="T",
        help="0: lowest cost wins; > 0: sample with probability ~ exp(-cost/T) (default 0)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the model's tokenizer (HF directory or .gguf; default: the replica's model path)",
    )
    # The engine's flags (their names and choices), here the replicas' values: no default.
    EngineArgs.add_cli_args(
        p,
        include=("block_size", "prefix_caching_hash_algo"),
        overrides=dict(
            block_size=dict(
                default=None,
                help="the replicas' KV block size, for those that do not report it (vLLM "
                "reports it on /metrics; a replica reporting another is refused)",
            ),
            prefix_caching_hash_algo=dict(
                default=None,
                help="the replicas' block hash algorithm, for those that do not report it "
                "(likewise checked against those that do)",
            ),
        ),
    )
    p.add_argument(
        "--hash-seed",
        default=None,
        metavar="S",
        help="the vLLM replicas' PYTHONHASHSEED (vLLM does not publish its hash seed; without "
        "one, sha256/sha256_cbor use vLLM's fixed default and xxhash cannot be mirrored)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--health-interval",
        metavar="SECONDS",
        type=float,
        default=1.0,
        help="how often each replica's /metrics is scraped (default 1)",
    )
    p.add_argument(
        "--startup-timeout",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="how long to wait for the replicas at start (default 60)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=600.0,
        help="longest wait for a replica's next bytes (default 600)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --temperature sampling (default 0)")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level (default warning)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.cli.serve import bind_socket, fail, serve_on_socket
    from pagedkv.router.replica import ReplicaSpec
    from pagedkv.router.scoring import RoutingWeights
    from pagedkv.router.server import RouterConfigError, RouterOptions, create_router_app

    if not 0 <= args.port <= 65535:
        return fail("router", ValueError(f"invalid --port {args.port}"))
    if not (
        args.overlap_weight >= 0
        and args.load_weight >= 0
        and 0 <= args.tier_credit <= 1
        and args.temperature >= 0
    ):
        return fail(
            "router",
            ValueError("weights must be >= 0, --tier-credit in [0, 1], --temperature >= 0"),
        )
    if args.block_size is not None and args.block_size < 1:
        return fail("router", ValueError(f"invalid --block-size {args.block_size}: must be >= 1"))
    if not (args.health_interval > 0 and args.timeout > 0 and args.startup_timeout >= 0):
        return fail(
            "router",
            ValueError("--health-interval and --timeout must be > 0, --startup-timeout >= 0"),
        )
    try:
        specs = [ReplicaSpec.parse(r) for r in args.replica]
        for u in args.decode or []:
            ReplicaSpec.parse(u)
    except ValueError as e:
        return fail("router", e)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return fail("router", OSError(f"cannot bind {args.host}:{args.port}: {e.strerror or e}"))
    options = RouterOptions(
        policy=args.policy,
        weights=RoutingWeights(
            args.overlap_weight, args.tier_credit, args.load_weight, args.temperature
        ),
        health_interval=args.health_interval,
        timeout=args.timeout,
        startup_timeout=args.startup_timeout,
        tokenizer=args.tokenizer,
        seed=args.seed,
        block_size=args.block_size,
        hash_algo=args.prefix_caching_hash_algo,
        hash_seed=args.hash_seed,
    )
    try:
        app = create_router_app(specs, options, decode=args.decode)
    except RouterConfigError as e:
        sock.close()
        return fail("router", e)
    state = app.state.router
    ref = state.reference
    print(
        f"pagedkv router: {args.policy} over {len(specs)} replicas "
        f"({sum(r.up for r in state.replicas.values())} up); block size {ref.block_size}, "
        f"{ref.hash_algo}; {len(state.index)} blocks indexed",
        flush=True,
    )
    return serve_on_socket(app, sock, "router", args.log_level)


if __name__ == "__main__":  # python -m pagedkv.entrypoints.cli.router ...
    parser = argparse.ArgumentParser(prog="pagedkv")
    parser_sub = parser.add_subparsers(dest="command")
    add_parser(parser_sub)
    sys.exit(run(parser.parse_args(["router", *sys.argv[1:]])))
