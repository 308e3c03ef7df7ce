"""Dense attention over already-gathered K/V, returning output and log-sum-exp.

``paged_attention`` gathers K/V blocks into a dense workspace and calls :func:`attend`. Two
kernels sit behind it, chosen per call:

* **flash** — torch's fused CPU flash-attention kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu``: tiled online softmax with float32
  accumulation, native GQA and bf16, returns the lse). Used on CPU when there is no soft cap
  and ``Dv == D``. It needs an additive float mask; it reports ``lse = 0`` for a row with no
  visible key, which we fix to ``−inf`` so that merges give that row weight 0.
* **matmul** — batched matmuls + explicit softmax in float32 (soft cap, ``Dv != D``, other
  devices). GQA without repeating K/V: one ``bmm`` per KV head with its ``G`` query heads as
  rows, reading the strided K/V views in place.
"""

from __future__ import annotations

import torch

try:  # a private aten op (stable since torch 2.2); without it everything takes the matmul path
    _flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
except (AttributeError, RuntimeError):
    _flash_cpu = None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    soft_cap: float | None = None,
    exact_empty_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, M, D]`` over ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]``.

    ``Hq = G·Hkv`` (query head ``h`` uses KV head ``h // G``). K/V may be strided views (unit
    last stride). ``mask``: bool, broadcastable to ``[B, M, L]``, True = visible, the same for
    every head. ``causal``: row ``m`` additionally sees only keys ``<= m`` (top-left aligned).
    Logits are ``scale·q·k``, soft-capped as ``c·tanh(s/c)`` before masking.
    Returns ``out [B, Hq, M, Dv]`` (q's dtype for flash, float32 for matmul: callers cast) and
    ``lse [B, Hq, M]`` float32; a row with no visible key has ``out = 0, lse = −inf`` (with
    ``exact_empty_lse=False`` its lse may be finite: saves a reduction when nothing merges).
    """
    if mask is not None and mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if (
        _flash_cpu is not None
        and soft_cap is None
        and q.device.type == "cpu"
        and k.shape[-1] == v.shape[-1]
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return _attend_flash_cpu(q, k, v, scale, mask, causal, exact_empty_lse)
    return _attend_matmul(q, k, v, scale, mask, causal, soft_cap)


def _causal_mask(m: int, n: int, device: torch.device) -> torch.Tensor:
    """``[m, n]`` bool: row ``i`` sees keys ``j <= i``."""
    return torch.ones(m, n, dtype=torch.bool, device=device).tril()


def _attend_flash_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    exact_empty_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, m, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    k, v = k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D] views
    if mask is not None and causal:
        mask, causal = mask & _causal_mask(m, k.shape[2], q.device), False
    fold = m == 1 and g > 1
    if fold:
        # Decode: the G query heads of one KV head become G rows of one head, so each K/V
        # row is loaded once for all of them (the mask is per (seq, key), so it still fits).
        q = q.reshape(b, hkv, g, d)
    bias = hidden = None
    if mask is not None:
        hidden = mask.logical_not()
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill_(hidden, float("-inf")).unsqueeze(1)  # [B|1, 1, M|1, L]
    out, lse = _flash_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    if hidden is not None and exact_empty_lse:
        empty = hidden.all(dim=-1)  # [B|1, M|1]
        if bool(empty.any()):
            lse = lse.masked_fill(
                empty.view(-1, 1, 1) if fold else empty.unsqueeze(-2), float("-inf")
            )
    if fold:
        out, lse = out.reshape(b, hq, 1, d), lse.reshape(b, hq, 1)
    return out, lse


def _attend_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    soft_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, m, d = q.shape
    n_keys, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    k, v = k.float(), v.float()  # no-op for float32 caches
    qh = q.reshape(b, hkv, g * m, d).float() * scale  # rows (g, m) of each KV head
    scores = torch.empty(hkv, b, g * m, n_keys, device=q.device)
    # One bmm per KV head: k[:, :, h] is a strided [B, L, D] view that BLAS reads in place,
    # whereas a single matmul over (B, Hkv) would first copy all of K.
    for h in range(hkv):
        torch.bmm(qh[:, h], k[:, :, h].transpose(1, 2), out=scores[h])
    s = scores.view(hkv, b, g, m, n_keys)
    if soft_cap is not None:
        s.div_(soft_cap).tanh_().mul_(soft_cap)
    if causal:
        causal_mask = _causal_mask(m, n_keys, q.device).unsqueeze(0)
        mask = causal_mask if mask is None else mask & causal_mask
    if mask is not None:
        s.masked_fill_(~mask.unsqueeze(1), float("-inf"))  # [B|1, 1, M|1, L]
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, B, G, M]
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = s.sub_(shift.unsqueeze(-1)).exp_().view(hkv, b, g * m, n_keys)
    out = torch.empty(hkv, b, g * m, dv, device=q.device)
    for h in range(hkv):
        torch.bmm(p[h], v[:, :, h], out=out[h])
    return (out.transpose(0, 1).reshape(b, hq, m, dv), lse.transpose(0, 1).reshape(b, hq, m))
