"""HTTP forwarding to ``pagedkv serve`` instances: the code the PD proxy
(`pagedkv.entrypoints.proxy`) and the KV-aware router (`pagedkv.router.server`) share.

    instances.py      Instance, InstancePool (round-robin, cooldown), ProxyState
    client.py         one request to one instance (InstanceFailed on what is worth retrying),
                      the client, and the responses a front end makes itself (503, 400)
    pd.py             run_prefill, run_decode, handle_completion, check_health
    relay.py          an SSE stream relayed to the client, resumed elsewhere if it breaks
    stream_resume.py  StreamTracker: the bookkeeping that makes a broken stream resumable

Every name here is public: the proxy and the router import nothing private from each other or
from this package. Below the entrypoints in the layers (tests/test_imports.py): it imports
nothing of pagedkv beyond itself; fastapi and httpx are imported where used.
"""

from pagedkv.forwarding.client import (
    InstanceFailed,
    forward_headers,
    instance_client,
    invalid_body,
    passthrough,
    read_body,
    send_request,
    unavailable,
)
from pagedkv.forwarding.instances import RETRY_PAUSE_S, Instance, InstancePool, ProxyState
from pagedkv.forwarding.pd import (
    PREFILL_KV_TRANSFER_PARAMS,
    check_health,
    handle_completion,
    prefill_body,
    run_decode,
    run_prefill,
)
from pagedkv.forwarding.relay import pump, relay_stream, resume_choice
from pagedkv.forwarding.stream_resume import ChoiceState, StreamTracker

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS",
    "RETRY_PAUSE_S",
    "ChoiceState",
    "Instance",
    "InstanceFailed",
    "InstancePool",
    "ProxyState",
    "StreamTracker",
    "check_health",
    "forward_headers",
    "handle_completion",
    "instance_client",
    "invalid_body",
    "passthrough",
    "prefill_body",
    "pump",
    "read_body",
    "relay_stream",
    "resume_choice",
    "run_decode",
    "run_prefill",
    "send_request",
    "unavailable",
]
