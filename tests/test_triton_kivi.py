"""The Triton KIVI decode kernel (``ops/triton/kivi_decode.py``) against the torch path of
`ops.kivi` on the batches of tests/test_kivi_native.py: four sequences (cold prefixes, a
whole-prompt hit, a prompt inside the sinks), decode steps across block boundaries and the
residual's ring, int3 and int2, block sizes 16 and 32.

Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), like
tests/test_triton_kv_quant.py; with ``TRITON_INTERPRET=0`` on CUDA the same tests run compiled.
"""

from __future__ import annotations

import os

_WE_SET_INTERPRET = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_kivi_native import _batch, _step  # noqa: E402
from triton_env import interpret_during_module  # noqa: E402

from pagedkv.ops import native  # noqa: E402
from pagedkv.ops.triton.kivi_decode import kivi_decode_triton  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("0", "")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip(
        "compiled Triton needs CUDA (set TRITON_INTERPRET=1 for the CPU interpreter)",
        allow_module_level=True,
    )
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
_interpret = interpret_during_module(_WE_SET_INTERPRET, INTERPRET)


@pytest.mark.parametrize(("mode", "bs", "steps"), [("int3_kivi", 16, 14), ("int2_kivi", 32, 6)])
def test_triton_reads_what_the_torch_path_reads(mode, bs, steps, monkeypatch) -> None:
    """After each decode step's writes (torch), the kernel's output matches the torch path's
    attention of that step to float rounding; the steps cross a block boundary (position 80 at
    block 16, 96 at 32) and the sequence whose prompt ends a block starts a new one."""
    monkeypatch.setattr(native, "lib", lambda: None)  # the torch path writes and attends
    kq, kc, vc, seqs = _batch(mode, bs)
    _step(kq, kc, vc, seqs, [(s, p) for p, s, *_ in seqs], bs)
    width = max(len(t) for _, _, t, *_ in seqs)
    table = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for _, _, t, *_ in seqs])
    rows = torch.arange(len(seqs))
    starts = torch.tensor([s for _, s, *_ in seqs])
    # the first sink each row holds: 0 for the row with restored sinks (_batch's last)
    sink_lo = torch.tensor([0 if x[-1] else min(s, 4) for _, s, *x in seqs])
    first = None
    for i in range(steps):
        spans = [(p + i, p + i + 1) for p, *_ in seqs]
        want = _step(kq, kc, vc, seqs, spans, bs)
        q = torch.cat([seq[3][lo:hi] for seq, (lo, hi) in zip(seqs, spans)])
        lens = torch.tensor([hi for _, hi in spans], dtype=torch.int32)
        dev = [x.to(DEVICE) for x in (q, kc, vc, table, lens, rows, starts, sink_lo)]
        if DEVICE.type == "cuda":
            kq.residual.k, kq.residual.v = kq.residual.k.cuda(), kq.residual.v.cuda()
        got = kivi_decode_triton(
            dev[0], dev[1], dev[2], dev[3], dev[4], 64**-0.5, kq, dev[5], dev[6], dev[7]
        ).cpu()
        if DEVICE.type == "cuda":
            kq.residual.k, kq.residual.v = kq.residual.k.cpu(), kq.residual.v.cpu()
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (i, (got - want).abs().max())
        first = got if first is None else first
    assert (got - first).abs().max() > 1e-2  # the steps attend to different keys


def test_triton_refuses_shapes_it_does_not_take() -> None:
    """A block size that does not divide the head size is a clear error, not a wrong read."""
    kq, kc, vc, _ = _batch("int3_kivi", 16)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="powers of two"):
        kivi_decode_triton(
            torch.zeros(1, 9, 48), kc, vc, one[None], one, 1.0, kq, one.long(), one.long()
        )
