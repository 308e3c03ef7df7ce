"""llama.cpp side of bench_latency.py, run by the llama-cpp-python venv's own Python.

Reads one JSON job from argv[1] ({"model", "threads", "n_ctx", "warmup", "runs": [{"tokens",
"max_tokens"}]}) and prints one JSON list, a dict per run: ``ttft_s`` (prompt evaluation through
the first sampled token), ``decode_s`` (the rest), ``output`` (token ids). Greedy (temp 0); the
prompt is given as token ids, so both engines see the same ids; the cache is reset before each
run so no run reuses another's prefix. EOS does not stop a run (as pagedkv's ``ignore_eos``).
Imports nothing from pagedkv (it is not installed in that venv).

A job with ``"batched": {"prompts": [[ids...], ...], "max_tokens": n}`` instead runs every
prompt at once as its own sequence of one llama.cpp context (llama-batched-bench's way, through
the C API): the prompts prefilled together in batches of ``n_batch`` tokens, then one
``llama_decode`` per step carrying one token of each sequence, greedy (argmax of each row's
logits). It prints one dict: ``wall_s`` (first prefill to last token), ``prefill_s`` and the
``outputs``.
"""

from __future__ import annotations

import json
import sys
import time


def batched(job: dict) -> dict:
    """Every prompt of ``job["batched"]`` decoded together (see the module docstring)."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    spec = job["batched"]
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["model"].encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = sum(len(p) + max_tokens for p in prompts) + 64
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = len(prompts)
    # one KV stream a sequence: a unified one makes every row attend over (masked) every
    # sequence's cells; llama.cpp advises this for sequences with no shared prefix
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(512, len(prompts)), 0, 1)

    def run(items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens = len(items)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        row = L.llama_get_logits_ith(ctx, i)
        return int(
            np.ctypeslib.as_array(
                ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,)
            ).argmax()
        )

    t0 = time.perf_counter()
    items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for a in range(0, len(items), 512):
        chunk = items[a : a + 512]
        run(chunk)
        for i, (_, _, s, want) in enumerate(chunk):
            if want:
                outputs[s].append(argmax(i))
    t_prefill = time.perf_counter()
    for _ in range(max_tokens - 1):
        run(
            [
                (out[-1], len(p) + len(out) - 1, s, True)
                for s, (p, out) in enumerate(zip(prompts, outputs))
            ]
        )
        for s, out in enumerate(outputs):
            out.append(argmax(s))
    t_end = time.perf_counter()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return dict(wall_s=t_end - t0, prefill_s=t_prefill - t0, outputs=outputs)


def main() -> int:
    job = json.loads(sys.argv[1])
    if "batched" in job:
        print(json.dumps(batched(job)))
        return 0
    from llama_cpp import Llama

    llm = Llama(
        model_path=job["model"],
        n_ctx=job["n_ctx"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_batch=512,
        verbose=False,
        seed=0,
    )

    def one(tokens: list[int], max_tokens: int) -> dict:
        llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        for tok in llm.generate(
            tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0
        ):
            if not out:
                t_first = time.perf_counter()
            out.append(int(tok))
            if len(out) >= max_tokens:
                break
        t_end = time.perf_counter()
        return dict(ttft_s=t_first - t0, decode_s=t_end - t_first, output=out)

    for w in job.get("warmup", []):
        one(w["tokens"], w["max_tokens"])
    print(json.dumps([one(r["tokens"], r["max_tokens"]) for r in job["runs"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
