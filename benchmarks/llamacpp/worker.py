"""llama.cpp side of bench_latency.py, run by the llama-cpp-python venv's own Python.

Reads one JSON job from argv[1] ({"model", "threads", "n_ctx", "warmup", "runs": [{"tokens",
"max_tokens"}]}) and prints one JSON list, a dict per run: ``ttft_s`` (prompt evaluation through
the first sampled token), ``decode_s`` (the rest), ``output`` (token ids). Greedy (temp 0); the
prompt is given as token ids, so both engines see the same ids; the cache is reset before each
run so no run reuses another's prefix. EOS does not stop a run (as pagedkv's ``ignore_eos``).
Imports nothing from pagedkv (it is not installed in that venv).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.loads(sys.argv[1])
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
