"""The block-sparse attention core shared by every sparse video backend.

Block-list format (like FlexAttention's ``BlockMask`` kv lists)::

    kv_indices  int32 [B, H, n_q_blocks, max_kv_blocks]   key blocks attended by each query block
    kv_counts   int32 [B, H, n_q_blocks]                  the first kv_counts[b, h, i] entries are valid

Query block ``i`` covers query positions ``[i*block_size, (i+1)*block_size)``; key block ``j``
covers key positions ``[j*block_size, (j+1)*block_size)``.  Valid entries are distinct, sorted
ascending (planners here always produce that; the kernels do not rely on the order) and lie in
``[0, n_kv_blocks)``; entries past ``kv_counts`` are ignored (planners fill them with 0).  A query
block with ``kv_counts == 0`` attends nothing: its rows are zero with LSE ``-inf``.  ``B`` and
``H`` may be 1 in the lists to broadcast over batch / heads.

``kv_valid`` (optional, bool ``[B, S_kv]`` or per-head ``[B, H, S_kv]``) marks real keys; False keys
(padding) are masked out inside the selected blocks.

Implementations (``impl``):

* ``"reference"`` — blocked PyTorch, exact, float32 accumulation (float64 for float64 input); the
  CPU path and the reference for the others.
* ``"flex"`` — ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the same lists
  (compiled on CUDA, eager elsewhere — eager is O(S^2) memory, for tests only).
* ``"triton"`` — ``ditattn.attention.kernels.block_sparse_triton.block_sparse_attention_triton``
  with ``impl="triton"`` (our Triton kernel and no other; imported lazily, CUDA tensors only), called with the
  same arguments as this function (``nonempty_rows`` included): k/v with their own (GQA) head count, lists
  contiguous int32 ``[B, H, ...]``, ``kv_valid`` None or ``[B, S_kv]``.
* ``"auto"`` — on CUDA, when that module is importable and the call fits it (fp16/bf16, the module's
  ``SUPPORTED_BLOCK_SIZES`` / ``SUPPORTED_HEAD_DIMS``, no per-head ``kv_valid``), its own choice
  (``impl="auto"``: FlashAttention-4's block-sparse forward at 128-token blocks where installed, the SM90
  kernel at 64-token tiles from 60,000 query tokens, else the Triton kernel), else flex; reference on CPU.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Optional

import torch

from ditattn.attention.reference import expand_kv
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor
log = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "flex", "triton")
_TRITON_MODULE = "ditattn.attention.kernels.block_sparse_triton"
# scores materialised per reference chunk (elements); bounds CPU memory
_REF_CHUNK_ELEMS = 1 << 24


# ------------------------------------------------------------------------------------------------
# list helpers


def block_mask_to_lists(block_mask: Tensor, width: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Boolean block mask ``[B, H, n_q_blocks, n_kv_blocks]`` -> ``(kv_indices, kv_counts)``.

    ``kv_indices`` is int32 ``[B, H, n_q_blocks, W]`` with each row's True columns in ascending
    order followed by zeros; ``kv_counts`` is int32 ``[B, H, n_q_blocks]``.  ``W`` is ``width`` when
    given (at least 1 and at most ``n_kv_blocks``: no device sync, the lists keep their shape from
    call to call), else ``max(1, max count)`` (one device sync to read the count).  Planners pass
    :func:`list_width` (fixed off the CPU, where a sync stalls the device; tight on the CPU, where
    the reference kernel's work grows with the width).
    """
    if block_mask.dtype != torch.bool or block_mask.dim() != 4:
        raise ValueError("block_mask must be a bool tensor [B, H, n_q_blocks, n_kv_blocks]")
    counts = block_mask.sum(-1)
    nk = block_mask.shape[-1]
    if width is None:
        width = max(1, int(counts.max())) if counts.numel() else 1
    elif not 1 <= width <= max(1, nk):
        raise ValueError(f"width must be in [1, n_kv_blocks={nk}], got {width}")
    # True columns first (ascending), then the rest
    keyv = torch.where(block_mask, 0, nk) + torch.arange(nk, device=block_mask.device)
    order = torch.argsort(keyv, dim=-1)[..., :width]
    slot = torch.arange(width, device=block_mask.device)
    order = torch.where(slot < counts.unsqueeze(-1), order, torch.zeros_like(order))
    return order.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()


def list_width(device: torch.device, n_kv_blocks: int) -> Optional[int]:
    """The ``width`` a planner passes to :func:`block_mask_to_lists`: ``n_kv_blocks`` on an
    accelerator (no sync; the kernels read only each row's counted slots), None on the CPU."""
    return None if torch.device(device).type == "cpu" else max(1, int(n_kv_blocks))


def lists_to_block_mask(kv_indices: Tensor, kv_counts: Tensor, n_kv_blocks: int) -> Tensor:
    """Inverse of :func:`block_mask_to_lists`: ``[B, H, n_q_blocks, n_kv_blocks]`` bool."""
    m = kv_indices.shape[-1]
    slot = torch.arange(m, device=kv_indices.device)
    live = slot < kv_counts.unsqueeze(-1).long()
    out = torch.zeros(*kv_indices.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=kv_indices.device)
    idx = torch.where(live, kv_indices.long(), torch.full_like(kv_indices, n_kv_blocks, dtype=torch.long))
    out.scatter_(-1, idx, True)
    return out[..., :n_kv_blocks]


def block_lists_to_dense_mask(
    kv_indices: Tensor,
    kv_counts: Tensor,
    *,
    block_size: int,
    seq_len_kv: Optional[int] = None,
    kv_valid: Optional[Tensor] = None,
) -> Tensor:
    """Explicit token mask of a block list, for tests: bool ``[B, H, S_q, S_kv]`` (True = attend)
    with ``S_q = n_q_blocks * block_size`` and ``S_kv = seq_len_kv`` (default ``S_q``); ``kv_valid``
    (``[B, S_kv]`` or ``[B, H, S_kv]``) additionally masks padding keys."""
    nq = kv_indices.shape[2]
    skv = nq * block_size if seq_len_kv is None else seq_len_kv
    nk = skv // block_size
    bm = lists_to_block_mask(kv_indices, kv_counts, nk)
    dense = bm.repeat_interleave(block_size, dim=2).repeat_interleave(block_size, dim=3)
    if kv_valid is not None:
        kvv = kv_valid if kv_valid.dim() == 3 else kv_valid.unsqueeze(1)
        dense = dense & kvv.unsqueeze(2)
    return dense


def full_lists(batch: int, heads: int, n_q_blocks: int, n_kv_blocks: int, device=None) -> tuple[Tensor, Tensor]:
    """Lists in which every query block attends every key block (dense attention)."""
    idx = torch.arange(n_kv_blocks, dtype=torch.int32, device=device).expand(batch, heads, n_q_blocks, -1)
    cnt = torch.full((batch, heads, n_q_blocks), n_kv_blocks, dtype=torch.int32, device=device)
    return idx, cnt


def kept_fraction(kv_counts: Tensor, n_kv_blocks: int) -> float:
    """Fraction of (query block, key block) pairs that a block list keeps."""
    total = kv_counts.numel() * n_kv_blocks
    return float(kv_counts.sum()) / total if total else 0.0


# ------------------------------------------------------------------------------------------------
# public entry point


def _check(q, k, v, kv_indices, kv_counts, block_size, kv_valid):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]")
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(f"incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H % Hkv:
        raise ValueError(f"query heads {H} must be a multiple of key/value heads {Hkv}")
    if block_size <= 0 or Sq % block_size or Skv % block_size:
        raise ValueError(f"sequence lengths ({Sq}, {Skv}) must be multiples of block_size {block_size}")
    nq = Sq // block_size
    if kv_indices.dim() != 4 or kv_counts.dim() != 3:
        raise ValueError("kv_indices must be [B, H, n_q_blocks, max_kv_blocks] and kv_counts [B, H, n_q_blocks]")
    if kv_indices.shape[2] != nq or kv_counts.shape[2] != nq:
        raise ValueError(f"block lists cover {kv_indices.shape[2]} query blocks, the queries have {nq}")
    for t, name in ((kv_indices, "kv_indices"), (kv_counts, "kv_counts")):
        if t.shape[0] not in (1, B) or t.shape[1] not in (1, H):
            raise ValueError(f"{name} batch/head dims {tuple(t.shape[:2])} must be ({B} or 1, {H} or 1)")
    if kv_valid is not None:
        if kv_valid.dtype != torch.bool or kv_valid.shape[-1] != Skv or kv_valid.dim() not in (2, 3):
            raise ValueError("kv_valid must be bool [B, S_kv] or [B, H, S_kv]")


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_indices: Tensor,
    kv_counts: Tensor,
    *,
    block_size: int = 64,
    scale: Optional[float] = None,
    kv_valid: Optional[Tensor] = None,
    return_lse: bool = False,
    impl: str = "auto",
    nonempty_rows: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Exact softmax attention of each query block over its listed key blocks.

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` (``H % H_kv == 0``), both lengths multiples of
    ``block_size``; block lists and ``kv_valid`` as in the module docstring.  ``scale`` defaults to
    ``D ** -0.5``.  ``nonempty_rows``: the caller guarantees that every query block lists at least
    one key block (lets the CUDA kernels skip a check that costs a device sync).  Returns ``(out [B, S_q, H, D] in
    q.dtype, lse [B, H, S_q] float32 natural log
    or None)``; rows with no valid key give zeros and LSE ``-inf``.
    """
    if impl not in IMPLS:
        raise AttentionConfigError(f"block-sparse impl must be one of {list(IMPLS)}, got {impl!r}")
    _check(q, k, v, kv_indices, kv_counts, block_size, kv_valid)
    B, Sq, H, D = q.shape
    scale = D**-0.5 if scale is None else float(scale)
    requested = impl
    if impl == "auto":
        impl = _auto_impl(q, block_size, kv_valid)
    if impl == "triton":
        from ditattn.attention.kernels import interpreting

        if not q.is_cuda and not interpreting():
            raise AttentionConfigError(
                "the Triton block-sparse kernel needs CUDA tensors (or TRITON_INTERPRET=1 on "
                "CPU); use impl='reference' on CPU"
            )
        fn = _load_triton()
        if fn is None:
            raise AttentionConfigError(
                f"the Triton block-sparse kernel ({_TRITON_MODULE}) is not available in this build"
            )
        if kv_valid is not None and kv_valid.dim() == 3:
            raise AttentionConfigError("the Triton block-sparse kernel takes kv_valid [B, S_kv] only; use impl='flex'")
        # the kernel serves grouped-query attention and broadcast (B or H = 1) lists itself
        return fn(
            q,
            k,
            v,
            kv_indices.to(torch.int32),
            kv_counts.to(torch.int32),
            block_size=block_size,
            scale=scale,
            kv_valid=kv_valid,
            return_lse=return_lse,
            nonempty_rows=nonempty_rows,
            impl="auto" if requested == "auto" else "triton",  # named: the Triton kernel, no other
        )
    kv_indices = kv_indices.expand(B, H, -1, -1)
    kv_counts = kv_counts.expand(B, H, -1)
    k, v = expand_kv(k, v, H)
    if impl == "flex":
        return _flex(q, k, v, kv_indices, kv_counts, block_size, scale, kv_valid, return_lse)
    return _reference(q, k, v, kv_indices, kv_counts, block_size, scale, kv_valid, return_lse)


# ------------------------------------------------------------------------------------------------
# dispatch helpers

_triton_fn = None
_triton_tried = False


def _load_triton():
    global _triton_fn, _triton_tried
    if not _triton_tried:
        _triton_tried = True
        try:
            mod = importlib.import_module(_TRITON_MODULE)
            _triton_fn = getattr(mod, "block_sparse_attention_triton", None)
        except ModuleNotFoundError as exc:
            if exc.name and not _TRITON_MODULE.startswith(exc.name) and exc.name != "triton":
                raise
            _triton_fn = None
        except ImportError as exc:  # triton present but broken: say so, use flex
            log.warning("Triton block-sparse kernel unavailable (%s); using FlexAttention", exc)
            _triton_fn = None
    return _triton_fn


def _triton_fits(q: Tensor, block_size: int, kv_valid) -> bool:
    """Whether the Triton kernel serves this call (dtype, head dim, block size, 2-D kv_valid)."""
    if kv_valid is not None and kv_valid.dim() == 3:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    sizes, dims = _triton_limits()
    return block_size in sizes and q.shape[-1] in dims


@functools.lru_cache(maxsize=None)
def _triton_limits() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The kernel module's (block sizes, head dims), read once."""
    mod = importlib.import_module(_TRITON_MODULE)
    return (
        tuple(getattr(mod, "SUPPORTED_BLOCK_SIZES", (16, 32, 64, 128))),
        tuple(getattr(mod, "SUPPORTED_HEAD_DIMS", (16, 32, 64, 128, 256))),
    )


def _auto_impl(q: Tensor, block_size: int, kv_valid) -> str:
    if not q.is_cuda:
        return "reference"
    if _load_triton() is not None and _triton_fits(q, block_size, kv_valid):
        return "triton"
    return "flex"


# ------------------------------------------------------------------------------------------------
# reference


def _reference(q, k, v, kv_indices, kv_counts, bs, scale, kv_valid, return_lse):
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    nq, nk = Sq // bs, Skv // bs
    m = kv_indices.shape[-1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    qb = q.transpose(1, 2).to(dt).reshape(B, H, nq, bs, D)
    kb = k.transpose(1, 2).to(dt).reshape(B, H, nk, bs, D)
    vb = v.transpose(1, 2).to(dt).reshape(B, H, nk, bs, D)
    if kv_valid is None:
        kvv = None
    elif kv_valid.dim() == 2:
        kvv = kv_valid.view(B, 1, nk, bs).expand(B, H, nk, bs)
    else:
        kvv = kv_valid.view(B, H, nk, bs)
    out = torch.zeros(B, H, nq, bs, D, dtype=dt, device=dev)
    lse = torch.full((B, H, nq, bs), float("-inf"), dtype=dt, device=dev)
    per_qblock = B * H * m * bs * max(bs, D)
    chunk = max(1, _REF_CHUNK_ELEMS // max(1, per_qblock))
    bi = torch.arange(B, device=dev).view(B, 1, 1, 1)
    hi = torch.arange(H, device=dev).view(1, H, 1, 1)
    slot = torch.arange(m, device=dev)
    counts = kv_counts.to(dev).long()
    indices = kv_indices.to(dev).long()
    for i0 in range(0, nq, chunk):
        i1 = min(nq, i0 + chunk)
        idx = indices[:, :, i0:i1].clamp(0, nk - 1)  # [B,H,c,m]
        live = slot < counts[:, :, i0:i1].unsqueeze(-1)  # [B,H,c,m]
        kg = kb[bi, hi, idx]  # [B,H,c,m,bs,D]
        vg = vb[bi, hi, idx]
        s = torch.einsum("bhcqd,bhcmkd->bhcqmk", qb[:, :, i0:i1], kg) * scale
        keep = live.unsqueeze(-1).expand(-1, -1, -1, -1, bs)  # [B,H,c,m,bs]
        if kvv is not None:
            keep = keep & kvv[bi, hi, idx]
        c = i1 - i0
        s = s.reshape(B, H, c, bs, m * bs)
        s = s.masked_fill(~keep.reshape(B, H, c, 1, m * bs), float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [B,H,c,bs]
        p = torch.exp(s - torch.where(torch.isfinite(l), l, torch.zeros_like(l)).unsqueeze(-1))
        o = torch.einsum("bhcqn,bhcnd->bhcqd", p, vg.reshape(B, H, c, m * bs, D))
        out[:, :, i0:i1] = o
        lse[:, :, i0:i1] = l
    out = out.reshape(B, H, Sq, D).transpose(1, 2).to(q.dtype)
    return out, (lse.reshape(B, H, Sq).to(torch.float32) if return_lse else None)


# ------------------------------------------------------------------------------------------------
# FlexAttention

_compiled_flex = None


def _flex_fn(device: torch.device):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def build_flex_block_mask(
    kv_indices: Tensor,
    kv_counts: Tensor,
    *,
    block_size: int,
    seq_len_q: int,
    seq_len_kv: int,
    kv_valid: Optional[Tensor] = None,
    device=None,
):
    """A FlexAttention ``BlockMask`` equal to the block lists (and ``kv_valid`` padding).

    Key blocks whose keys are all valid go into the "full" lists (no mask evaluation in the fused
    kernel), the others into the partial lists.  The ``mask_mod`` encodes the whole token mask
    (block membership and key validity) because eager FlexAttention evaluates it everywhere.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device) if device is not None else kv_indices.device
    nk = seq_len_kv // block_size
    B, H = kv_indices.shape[:2]
    bm = lists_to_block_mask(kv_indices.to(device), kv_counts.to(device), nk)  # [B,H,nq,nk]
    if kv_valid is None:
        full_bm = bm
        valid = None
    else:
        valid = kv_valid.to(device)
        vb = valid.view(*valid.shape[:-1], nk, block_size).all(-1)  # [B,nk] or [B,H,nk]
        vb = vb.unsqueeze(1) if vb.dim() == 2 else vb
        full_bm = bm & vb.unsqueeze(2)
    part_bm = bm & ~full_bm

    def pad_lists(mask):
        idx, cnt = block_mask_to_lists(mask)
        ind = torch.zeros(*idx.shape[:3], nk, dtype=torch.int32, device=device)
        ind[..., : idx.shape[-1]] = idx
        return cnt, ind

    full_cnt, full_ind = pad_lists(full_bm)
    part_cnt, part_ind = pad_lists(part_bm)
    if valid is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return bm[b, h, q_idx // block_size, kv_idx // block_size]
    elif valid.dim() == 2:

        def mask_mod(b, h, q_idx, kv_idx):
            return bm[b, h, q_idx // block_size, kv_idx // block_size] & valid[b, kv_idx]
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return bm[b, h, q_idx // block_size, kv_idx // block_size] & valid[b, h, kv_idx]

    return BlockMask.from_kv_blocks(
        part_cnt,
        part_ind,
        full_cnt,
        full_ind,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(seq_len_q, seq_len_kv),
    )


def _flex(q, k, v, kv_indices, kv_counts, bs, scale, kv_valid, return_lse):
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    bm = build_flex_block_mask(
        kv_indices.contiguous(),
        kv_counts.contiguous(),
        block_size=bs,
        seq_len_q=Sq,
        seq_len_kv=Skv,
        kv_valid=kv_valid,
        device=q.device,
    )
    fn = _flex_fn(q.device)
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    # the fused kernel's tiles must divide the mask's blocks (its defaults are 128 x 64)
    kopt = {"BLOCK_M": bs, "BLOCK_N": bs} if q.is_cuda and bs < 128 else None
    if return_lse:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = fn(qh, kh, vh, block_mask=bm, scale=scale, kernel_options=kopt, return_aux=AuxRequest(lse=True))
            lse = aux.lse
        except ImportError:  # older torch
            out, lse = fn(qh, kh, vh, block_mask=bm, scale=scale, kernel_options=kopt, return_lse=True)
        out = out.transpose(1, 2)
        # FlexAttention's empty rows: lse -inf, output zero
        return out.to(q.dtype), lse.to(torch.float32)
    out = fn(qh, kh, vh, block_mask=bm, scale=scale, kernel_options=kopt)
    return out.transpose(1, 2).to(q.dtype), None


def _pick_block(n: int) -> int:
    for cand in (128, 64, 32, 16, 8, 4, 2):
        if n % cand == 0:
            return cand
    return 1


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Dense non-causal attention for the dense phases of sparse backends (``[B, S, H, D]`` in and
    out, GQA allowed), through ``ditattn.attention`` with ``backend`` (a dense backend name) or,
    when None, the platform's automatic dense choice (FlashAttention-4 on the H200, SDPA on the
    CPU; a global force never turns this back into a sparse backend).
    Returns ``(out, lse [B, H, S] float32 or None)``."""
    from ditattn.attention.functional import attention, auto_dense_attention, auto_dense_backend

    # the named backend when it is the automatic choice: the cached decision, not the public entry's per-call
    # selection (on the H200 Sol's dense_backend "fa" through ditattn.attention ran at 0.93x of this path)
    if backend is None or backend == auto_dense_backend(q, k, return_lse):
        return auto_dense_attention(q, k, v, scale=scale, return_lse=return_lse)
    res = attention(q, k, v, backend=backend, scale=scale, return_lse=return_lse)
    if isinstance(res, tuple):
        return res[0], (res[1] if return_lse else None)
    return res, None
