"""KV-aware request routing over several ``pagedkv serve`` replicas (``pagedkv router``).

Pure parts (no torch, no I/O; `pagedkv.sim` imports them too):

    index.py    PrefixIndex: block hash -> replicas holding it (device or tier), fed by KV events
    scoring.py  RoutingPolicy: kv (longest cached prefix vs load, Dynamo's cost), load, round-robin
    hashing.py  prompt_block_hashes: a prompt's block hashes exactly as the replicas' events carry them

I/O parts: subscriber.py (ZMQ subscription + replay per replica), server.py (the FastAPI app).
"""
