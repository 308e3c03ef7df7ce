"""``pagedkv events``: subscribe to a server's KV events and print one JSON line per event.

The subscription is opened before the replay, and live batches already replayed are skipped,
so nothing is lost or printed twice. ``DESCRIPTION`` is the user-facing help.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

DESCRIPTION = """\
Subscribe to a server's KV cache events (vLLM's ZMQ wire format) and print one JSON line per
event: {"seq": N, "ts": ..., "dp_rank": ..., "type": "BlockStored", "block_hashes": [...], ...},
hashes as hex strings.

With --replay-endpoint the buffered batches from --from-seq are printed first, then live ones,
with nothing lost or printed twice. --count N exits after N events; --idle-timeout S exits after
S seconds without events; otherwise it runs until interrupted. After --silence-warning seconds
without any event it says so on standard error (the usual cause: the server was started
without --enable-kv-cache-events, or on other endpoints). A gap in the live sequence numbers is
reported on standard error.
"""

EXAMPLES = """\
examples:
  pagedkv serve --enable-kv-cache-events --kv-events-replay-endpoint tcp://127.0.0.1:5558
  pagedkv events --endpoint tcp://127.0.0.1:5557
  pagedkv events --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --from-seq 0
"""

ENDPOINT_FORM = "endpoints look like tcp://127.0.0.1:5557 or ipc:///tmp/pagedkv-events"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "events",
        help="print a server's KV cache events (ZMQ)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--endpoint",
        default="tcp://127.0.0.1:5557",
        help="the server's event (PUB) endpoint (default tcp://127.0.0.1:5557)",
    )
    p.add_argument("--replay-endpoint", default=None, help="the server's replay (ROUTER) endpoint")
    p.add_argument(
        "--from-seq",
        type=int,
        default=0,
        help="with --replay-endpoint: first sequence number (default 0)",
    )
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--count", type=int, default=None, help="exit after this many events")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="exit after this many seconds without events",
    )
    p.add_argument(
        "--silence-warning",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="say so on stderr after this many seconds without events (default 10; 0: never)",
    )
    p.set_defaults(func=run)
    return p


def silence_message(seconds: float) -> str:
    return (
        f"pagedkv events: no events in {seconds:g} s: is the server running with KV events enabled "
        f"(pagedkv serve --enable-kv-cache-events) on this endpoint?"
    )


def run(args: argparse.Namespace) -> int:
    from pagedkv.core.event_transport import KVEventSubscriber, iter_event_lines

    if args.from_seq < 0:
        print("pagedkv events: error: --from-seq must be >= 0", file=sys.stderr)
        return 2
    if args.count is not None and args.count < 1:
        print("pagedkv events: error: --count must be >= 1", file=sys.stderr)
        return 2
    printed = 0
    last_seq = -1

    def emit(seq: int, batch: Any) -> bool:
        nonlocal printed
        for line in iter_event_lines(seq, batch):
            print(json.dumps(line), flush=True)
            printed += 1
            if args.count is not None and printed >= args.count:
                return True
        return False

    import zmq

    try:
        sub_cm = KVEventSubscriber(args.endpoint, args.replay_endpoint, args.topic)
    except zmq.ZMQError as e:
        print(
            f"pagedkv events: error: cannot connect to --endpoint {args.endpoint!r}"
            f"{f' / --replay-endpoint {args.replay_endpoint!r}' if args.replay_endpoint else ''}: "
            f"{e.strerror}; {ENDPOINT_FORM}",
            file=sys.stderr,
        )
        return 2
    warned = False
    try:
        with sub_cm as sub:
            if args.replay_endpoint:
                time.sleep(0.1)  # let the SUB connect before asking, so live batches are not missed
                for seq, batch in sub.replay(args.from_seq):
                    last_seq = seq
                    if emit(seq, batch):
                        return 0
            idle_since = time.monotonic()
            while True:
                got = sub.recv(timeout=0.25)
                if got is None:
                    idle = time.monotonic() - idle_since
                    if args.idle_timeout is not None and idle > args.idle_timeout:
                        return 0
                    if args.silence_warning > 0 and idle > args.silence_warning and not warned:
                        print(silence_message(args.silence_warning), file=sys.stderr, flush=True)
                        warned = True  # once per silence: an idle server is not an error
                    continue
                idle_since = time.monotonic()
                warned = False
                seq, batch = got
                if seq <= last_seq:
                    continue  # already printed by the replay
                if last_seq >= 0 and seq != last_seq + 1:
                    print(
                        f"pagedkv events: missed batches {last_seq + 1}..{seq - 1}", file=sys.stderr
                    )
                last_seq = seq
                if emit(seq, batch):
                    return 0
    except KeyboardInterrupt:
        return 0
    except TimeoutError as e:
        print(
            f"pagedkv events: error: replay: {e}: is the server running with "
            f"--kv-events-replay-endpoint {args.replay_endpoint}?",
            file=sys.stderr,
        )
        return 2
