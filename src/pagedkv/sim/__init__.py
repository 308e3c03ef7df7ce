"""`pagedkv simulate`: a discrete-event fleet simulator whose replicas are the real core/ KV cache
manager (and the real CPU offload tier bookkeeping), with the forward pass replaced by a cost
model, routed by `pagedkv router`'s own scoring and prefix index.

Modules: `trace` (JSONL traces, generators), `hashes` (block hashes over the prefix tree),
`cost` (step-time model, GPU table), `replica` (one engine: scheduler mirror + real
KVCacheManager), `fleet` (event loop, routing, report), `report` (percentiles, table), `plot`
(sweep PNGs, matplotlib), `calibrate` (fit the cost model to the real engine: the only torch
user), `cli` (the subcommands). Nothing here imports torch except `calibrate`, lazily.
"""
