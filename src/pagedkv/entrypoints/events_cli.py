"""``pagedkv events``: subscribe to a server's KV events and print one JSON line per event.

    pagedkv events --endpoint tcp://127.0.0.1:5557
    pagedkv events --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --from-seq 0

Each line: ``{"seq": N, "ts": ..., "dp_rank": ..., "type": "BlockStored", "block_hashes":
[...], ...}`` (hashes as hex strings when they are bytes). With ``--replay-endpoint`` the
buffered batches from ``--from-seq`` are printed first, then live ones (the subscription is
opened before the replay, and live batches already replayed are skipped, so nothing is lost or
printed twice). ``--count N`` exits after N events; ``--idle-timeout S`` exits after S seconds
without events; otherwise it runs until interrupted. A gap in the live sequence numbers (the
subscriber fell behind, or joined late without replay) is reported on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("events", help="print a server's KV cache events (ZMQ)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the server's PUB endpoint")
    p.add_argument("--replay-endpoint", default=None, help="the server's replay (ROUTER) endpoint")
    p.add_argument("--from-seq", type=int, default=0, help="with --replay-endpoint: first sequence number")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--count", type=int, default=None, help="exit after this many events")
    p.add_argument("--idle-timeout", type=float, default=None, help="exit after this many idle seconds")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.kv_events import KVEventSubscriber, iter_event_lines

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

    try:
        with KVEventSubscriber(args.endpoint, args.replay_endpoint, args.topic) as sub:
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
                    if args.idle_timeout is not None and time.monotonic() - idle_since > args.idle_timeout:
                        return 0
                    continue
                idle_since = time.monotonic()
                seq, batch = got
                if seq <= last_seq:
                    continue  # already printed by the replay
                if last_seq >= 0 and seq != last_seq + 1:
                    print(f"pagedkv events: missed batches {last_seq + 1}..{seq - 1}", file=sys.stderr)
                last_seq = seq
                if emit(seq, batch):
                    return 0
    except KeyboardInterrupt:
        return 0
    except TimeoutError as e:
        print(f"pagedkv events: error: replay: {e}", file=sys.stderr)
        return 1
