"""Mamba-2 mixer kernels in pure torch: causal depthwise conv with a conv state, the chunked
SSD scan for prefill (with an initial state), the recurrent step for decode, and the views of
a Mamba state inside one KV-cache page.

Shapes (one sequence; ``T`` tokens, ``H`` heads of ``P`` channels, ``G`` groups of ``N``
state dims, ``C`` conv channels, kernel ``K``):

* conv state ``[C, K-1]``: the last ``K-1`` conv inputs, oldest first (vLLM's layout; HF keeps
  ``K`` columns);
* SSM state ``[H, P, N]``.

Recurrence (what every function here computes, see :func:`ssd_sequential`), per head ``h``::

    dA_t = exp(dt_t·A)            h_t = dA_t·h_{t-1} + dt_t·x_t ⊗ B_t
    y_t  = h_t·C_t + D·x_t

``ssd_chunk_scan`` is the Mamba-2 paper's ``ssd_minimal_discrete`` (Listing 1) in float32 as
transformers' ``mamba2_chunk_scan`` writes it (stable masked-cumsum ``segment_sum``); splitting
the sequence differently reorders float sums only (~1e-6), never changes the math.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [T, C]`` continuing from ``conv_state [C, K-1]`` (None:
    zeros, a sequence start); ``weight [C, K]``. Returns ``(out [T, C]`` before activation,
    ``new conv_state [C, K-1])``; the inputs are not modified."""
    c, k = weight.shape
    xt = x.t().to(weight.dtype)
    if conv_state is None:
        conv_state = xt.new_zeros(c, k - 1)
    full = torch.cat([conv_state.to(weight.dtype), xt], dim=1)  # [C, K-1+T]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=c)[0]  # [C, T]
    return out.t(), full[:, full.shape[1] - (k - 1) :].clone()


def causal_conv1d_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the conv for ``S`` sequences: ``x [S, C]``, ``conv_state [S, C, K-1]``.
    Returns ``(out [S, C]`` before activation, ``new conv_state [S, C, K-1])``."""
    full = torch.cat(
        [conv_state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=2
    )  # [S, C, K]
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return out, full[:, :, 1:]


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1:i+1])`` for ``j <= i``, ``-inf`` above the diagonal
    (stable: a masked cumsum, no differences of large cumsums)."""
    n = x.shape[-1]
    x = x[..., None].expand(*x.shape, n)
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1)
    out = torch.cumsum(x.masked_fill(~lower, 0), dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD over one sequence, in float32.

    ``x [T, H, P]``, ``dt [T, H]`` (already softplus'd and clamped), ``A [H]`` (negative),
    ``B``/``C [T, G, N]`` (groups repeated to heads), ``D [H]`` or None, ``initial_state
    [H, P, N]`` or None (zeros). Returns ``(y [T, H, P]`` float32, ``final_state [H, P, N])``.
    ``T`` need not be a multiple of ``chunk_size`` (zero padding: dt = 0 keeps the state)."""
    t, h, p = x.shape
    g = B.shape[1]
    x = x.float()
    B = B.float().repeat_interleave(h // g, dim=1)
    C = C.float().repeat_interleave(h // g, dim=1)
    pad = (chunk_size - t % chunk_size) % chunk_size
    D_residual = None if D is None else D.float()[:, None] * x
    xdt = x * dt.float()[..., None]
    Adt = A.float() * dt.float()  # [T, H]

    def chunks(v: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [1, c, l, ...]
        v = F.pad(v, (0, 0) * (v.dim() - 1) + (0, pad))
        return v.reshape(1, -1, chunk_size, *v.shape[1:])

    X, Ac, Bc, Cc = chunks(xdt), chunks(Adt), chunks(B), chunks(C)
    Ac = Ac.permute(0, 3, 1, 2)  # [b, h, c, l]
    A_cumsum = torch.cumsum(Ac, dim=-1)
    # 1. intra-chunk (diagonal blocks): attention-like with the decay mask
    L = torch.exp(segment_sum(Ac))
    G = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc)
    M = G * L.permute(0, 2, 3, 4, 1)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", M, X)
    # 2. each chunk's own final state
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = Bc * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, X)
    # 3. inter-chunk recurrence: the state at every chunk start, and the final state
    prev = (
        initial_state.float()[None, None]
        if initial_state is not None
        else torch.zeros_like(states[:, :1])
    )
    states = torch.cat([prev, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # 4. chunk-start state -> outputs
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", Cc, states)
    Y_off = C_times_states * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (Y_diag + Y_off).reshape(-1, h, p)[:t]
    if D_residual is not None:
        y = y + D_residual
    return y, final_state[0]


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """One recurrent step (decode) for ``S`` sequences: ``state [S, H, P, N]`` float32 is
    updated in place; ``x [S, H, P]``, ``dt [S, H]`` (softplus'd, clamped), ``A [H]``,
    ``B``/``C [S, G, N]``, ``D [H]``. Returns ``y [S, H, P]`` float32."""
    s, h, p = x.shape
    g = B.shape[1]
    x = x.float()
    dtf = dt.float()[..., None]  # [S, H, 1]
    dA = torch.exp(dtf * A.float()[None, :, None])  # [S, H, 1]
    Bh = B.float().repeat_interleave(h // g, dim=1)  # [S, H, N]
    Ch = C.float().repeat_interleave(h // g, dim=1)
    dBx = (dtf * Bh)[:, :, None, :] * x[..., None]  # [S, H, P, N]
    new = state * dA[..., None] + dBx
    state.copy_(new)
    y = torch.einsum("shpn,shn->shp", new, Ch)
    if D is not None:
        y = y + x * D.float()[None, :, None]
    return y


def ssd_sequential(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the recurrence one token at a time (float64 inside for a tight oracle).
    Same arguments and results as :func:`ssd_chunk_scan` (without ``chunk_size``)."""
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    state = (
        torch.zeros(h, p, n, dtype=torch.float64)
        if initial_state is None
        else initial_state.double().clone()
    )
    Bh = B.double().repeat_interleave(h // g, dim=1)
    Ch = C.double().repeat_interleave(h // g, dim=1)
    ys = []
    for i in range(t):
        dti = dt[i].double()
        state = (
            state * torch.exp(dti * A.double())[:, None, None]
            + (dti[:, None] * Bh[i])[:, None, :] * x[i].double()[..., None]
        )
        y = torch.einsum("hpn,hn->hp", state, Ch[i])
        if D is not None:
            y = y + D.double()[:, None] * x[i].double()
        ys.append(y)
    return torch.stack(ys).float() if ys else x.new_zeros(0, h, p).float(), state.float()


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Mamba-2's norm after the scan: ``x·silu(gate)``, RMS-normalised per group of
    ``group_size`` channels (float32), then scaled by ``weight`` (HF ``MambaRMSNormGated``)."""
    dtype = x.dtype
    h = x.float() * F.silu(gate.float())
    shape = h.shape
    hg = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hg.view(shape).to(dtype)


def mamba_state_views(
    pages: torch.Tensor, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]
) -> tuple[torch.Tensor, ...]:
    """Views of one Mamba layer's states inside its KV-cache pages: ``pages [num_blocks,
    page_bytes]`` uint8 (one raw page per block id, vLLM's sharing of the attention layer slot)
    → one ``[num_blocks, *shape]`` tensor per state, packed one after the other from the start
    of each page (the rest of the page is padding). Writes through them land in the cache."""
    out = []
    offset = 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        tdtype = getattr(torch, dtype)
        nbytes = math.prod(shape) * torch.empty(0, dtype=tdtype).element_size()
        if offset + nbytes > pages.shape[1]:
            raise ValueError(f"Mamba states need more than the {pages.shape[1]}-byte page")
        out.append(pages[:, offset : offset + nbytes].view(tdtype).view(pages.shape[0], *shape))
        offset += nbytes
    return tuple(out)


def slot_pages(buffer: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    """The raw pages of KV-cache layer slot ``slot``: ``[num_blocks, page_bytes]`` uint8, a view
    of ``buffer`` (dims in ``layout`` order). Needs a layout where one block of one layer is
    contiguous (``L`` and ``B`` outermost: LBNHC, LBHNC, BLNHC, BLHNC); NotImplementedError
    otherwise."""
    name = str(getattr(layout, "name", layout)).upper()
    if name.startswith("LB"):
        layer = buffer[slot]
    elif name.startswith("BL"):
        layer = buffer[:, slot]
    else:
        raise NotImplementedError(
            f"this model needs a KV cache layout with a contiguous page per layer and "
            f"block (LBNHC, LBHNC, BLNHC or BLHNC), not {name}"
        )
    return layer.reshape(layer.shape[0], -1).view(torch.uint8)
