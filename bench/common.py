"""Shared helpers of the GPU benchmarks (method: docs/benchmarks.md): timing, FLOPs, references, output.

Timing is the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls,
warm-up first).  Accuracy is the relative L2 error ``|out - ref| / |ref|`` against a float32
reference computed on a random subset of query rows (full key set), TF32 disabled.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Callable, Optional

import torch

#: where the benchmarks run; BENCH_DEVICE=cpu (with TRITON_INTERPRET=1 and tiny shapes) smoke-tests
#: the scripts' code paths on a machine without a GPU (the timings then mean nothing)
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "src") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "src"))

#: Wan2.1 DiT architectures (diffusers WanTransformer3DModel config fields) for the end-to-end and
#: multi-GPU step benchmarks; "tiny" is a CPU smoke-test size
WAN_ARCH = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
    "tiny": dict(num_attention_heads=2, attention_head_dim=128, ffn_dim=256, num_layers=2),
}
WAN_COMMON = dict(
    patch_size=(1, 2, 2),
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
#: output resolutions (height, width) in pixels
WAN_RES = {"480p": (480, 832), "720p": (720, 1280), "tiny": (64, 64)}


def add_wan_args(ap, *, text_len: bool = True) -> None:
    """The Wan benchmark shape flags shared by bench/e2e.py, bench/generate.py and bench/multigpu.py."""
    ap.add_argument("--arch", default="1.3b", choices=sorted(WAN_ARCH))
    ap.add_argument("--res", default="480p", choices=sorted(WAN_RES))
    ap.add_argument("--frames", type=int, default=81)
    if text_len:
        ap.add_argument("--text-len", type=int, default=512)


#: the latent token grids (T, H, W) of Wan 480p / 720p x 81 frames
WAN_GRIDS = {"wan480": (21, 30, 52), "wan720": (21, 45, 80)}


def add_grid_args(ap, *, grids: str = "wan480", heads: str = "12,40") -> None:
    """``--grids`` (names of :data:`WAN_GRIDS`), ``--grid T,H,W`` (override, e.g. a small grid for a CPU smoke
    run) and ``--heads`` (comma list); read them back with :func:`grid_args`."""
    ap.add_argument("--grids", default=grids, help=f"comma list of {', '.join(WAN_GRIDS)} (default {grids})")
    ap.add_argument("--grid", default=None, help="override: T,H,W (e.g. 5,8,12 for a CPU smoke run)")
    ap.add_argument("--heads", default=heads, help=f"comma list of head counts (default {heads})")


def grid_args(ap, args) -> tuple[list[tuple[str, tuple[int, int, int]]], list[int]]:
    """``([(name, (T, H, W)), ...], [heads, ...])`` from :func:`add_grid_args`' flags; bad values end in
    ``ap.error`` (one line, exit status 2)."""
    try:
        if args.grid:
            grid = tuple(int(x) for x in args.grid.split(","))
            if len(grid) != 3 or min(grid) < 1:
                raise ValueError
            grids = [("x".join(map(str, grid)), grid)]
        else:
            grids = [(g, WAN_GRIDS[g]) for g in args.grids.split(",")]
    except (ValueError, KeyError):
        ap.error(
            f"--grid takes T,H,W (three positive integers), --grids names from {', '.join(WAN_GRIDS)}: "
            f"got --grid {args.grid!r} --grids {args.grids!r}"
        )
    try:
        heads = [int(h) for h in args.heads.split(",")]
        if min(heads) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--heads takes a comma list of positive integers, got {args.heads!r}")
    return grids, heads


def attn_flops(b: int, h: int, sq: int, skv: int, d: int) -> float:
    """Dense attention forward FLOPs, ``4 * B * H * Sq * Skv * D``."""
    return 4.0 * b * h * sq * skv * d


def bench_ms(fn: Callable[[], object], warmup_ms: float = 100, rep_ms: float = 400) -> float:
    """Median milliseconds of ``fn()`` (do_bench; the first call also absorbs compilation)."""
    if DEVICE != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def kernel_ms(fn: Callable[[], object], iters: int = 10) -> Optional[float]:
    """GPU kernel time of one ``fn()`` call in milliseconds: the sum of the durations of the kernels
    (and copies) it puts on the GPU timeline, averaged over ``iters`` calls under torch.profiler.
    Unlike :func:`bench_ms` it excludes host-side launch overhead and idle gaps between kernels.
    None off CUDA."""
    if DEVICE != "cuda":
        return None
    fn()
    return profile_step(lambda: [fn() for _ in range(iters)], top=0)["busy_ms"] / iters


#: kernel-name fragments -> category, first match wins (raw top kernels are recorded too)
_CATEGORIES = [
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa", "block_sparse", "int8_", "sage")),
    ("quantize", ("_quantize_rows",)),  # the FP8 linears' activation quantizer
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "cublas", "splitk")),
    ("inductor-fused", ("triton_",)),
    ("norm", ("norm",)),
    ("copy/cast", ("copy", "cast", "convert", "cat", "transpose", "permute")),
]


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise/other"


def profile_step(fn, top: int = 25) -> dict:
    """One step under torch.profiler: GPU kernel time per category, the top kernels, and the wall time.

    ``busy_ms`` is the sum of kernel times; wall - busy is launch gaps and host work (syncs show up there).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels: dict[str, list] = {}
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):  # a kernel (or memcpy) on the GPU timeline
            k = kernels.setdefault(ev.name, [0.0, 0])
            k[0] += ev.time_range.elapsed_us() / 1e3
            k[1] += 1
    cats: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        cats[_category(name)] = cats.get(_category(name), 0.0) + ms
    busy = sum(cats.values())
    tops = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "wall_ms": wall,
        "busy_ms": busy,
        "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n[:160], "ms": ms, "calls": c, "category": _category(n)} for n, (ms, c) in tops],
    }


def require_cuda(hint: str = "set BENCH_DEVICE=cpu with --grid for a smoke run, or use --counts-only") -> None:
    """Exit with a one-line error when the benchmarks target CUDA but no CUDA device is present."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: no CUDA device ({hint})")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _compare_dtype(out: torch.Tensor, ref: torch.Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (out.dtype, ref.dtype) else torch.float32


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (L2 over everything) in float32, or float64 if either is; NaN if ``out`` is
    not finite."""
    dt = _compare_dtype(out, ref)
    out, ref = out.to(dt), ref.to(dt)
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of ``out`` and ``ref`` flattened, in float32 (float64 if either is)."""
    dt = _compare_dtype(out, ref)
    return float(torch.nn.functional.cosine_similarity(out.to(dt).flatten(), ref.to(dt).flatten(), dim=0))


def make_qkv(b, s, h, d, *, hkv=None, dtype=torch.bfloat16, seed=0, device=None):
    """Fresh random normal q, k, v ``[B, S, H, D]`` (never zeros)."""
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    hkv = h if hkv is None else hkv
    q = torch.randn(b, s, h, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(b, s, hkv, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(b, s, hkv, d, generator=g, device=device, dtype=dtype)
    return q, k, v


def structured_qkv(b, grid, h, d, *, hkv=None, dtype=torch.bfloat16, seed=0, device=None, norm_range=(10.0, 16.0)):
    """Structured q, k, v ``[B, T*H*W, H, D]`` on a Wan latent token grid ``(T, H, W)``:
    per head a content vector ``a`` (norm drawn in ``norm_range``) plus unit noise, for q and for k,
    each rotated by Wan's 3-D RoPE at its token's (t, h, w), so attention decays with 3-D distance
    as in trained video DiTs; v is i.i.d. normal."""
    from ditattn.models.fused import apply_rope
    from ditattn.models.wan.transformer import rope_tables

    device = device or DEVICE
    g = torch.Generator(device="cpu").manual_seed(seed)
    hkv = h if hkv is None else hkv
    s = grid[0] * grid[1] * grid[2]
    cos, sin = rope_tables(d, tuple(grid), device)

    def content(nh):
        a = torch.randn(nh, d, generator=g)
        norms = torch.empty(nh).uniform_(*norm_range, generator=g)
        return (a / a.norm(dim=-1, keepdim=True) * norms[:, None]).to(device)

    def side(nh, a):
        x = a[None, None] + torch.randn(b, s, nh, d, generator=g).to(device)
        return apply_rope(x, cos, sin).to(dtype)

    a_q = content(h)
    a_k = a_q.view(hkv, h // hkv, d).mean(1) if hkv != h else a_q
    q = side(h, a_q)
    k = side(hkv, a_k)
    v = torch.randn(b, s, hkv, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def sample_rows(s: int, n: int, seed: int = 1, device=None) -> torch.Tensor:
    device = device or DEVICE
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = min(n, s)
    return torch.randperm(s, generator=g)[:n].sort().values.to(device)


def reference_rows(
    q, k, v, rows: torch.Tensor, *, scale: Optional[float] = None, mask_fn: Optional[Callable] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention of the query ``rows`` over all keys: ``(out [B, n, H, D], lse [B, H, n])``.

    ``mask_fn(rows, head_slice)`` may return a bool ``[B or 1, h, n, Skv]`` mask (True = attend).
    Computed per head group to bound memory; TF32 is off.
    """
    if q.device.type == "cpu":
        q, k, v = q.float(), k.float(), v.float()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        B, S, H, D = q.shape
        hkv = k.shape[2]
        rep = H // hkv
        scale = D**-0.5 if scale is None else scale
        qs = q[:, rows].float()
        n = rows.numel()
        out = torch.empty(B, n, H, D, device=q.device)
        lse = torch.empty(B, H, n, device=q.device)
        per = max(1, int(2**30 // max(1, B * n * k.shape[1] * 4)))
        for h0 in range(0, H, per):
            h1 = min(H, h0 + per)
            hk = torch.arange(h0, h1, device=q.device) // rep
            kk = k[:, :, hk].float().transpose(1, 2)
            vv = v[:, :, hk].float().transpose(1, 2)
            s_ = (qs[:, :, h0:h1].transpose(1, 2) @ kk.transpose(-1, -2)) * scale
            if mask_fn is not None:
                s_ = s_.masked_fill(~mask_fn(rows, slice(h0, h1)), float("-inf"))
            l_ = torch.logsumexp(s_, dim=-1)
            p = torch.exp(s_ - l_[..., None]).nan_to_num(0.0)
            out[:, :, h0:h1] = (p @ vv).transpose(1, 2)
            lse[:, h0:h1] = l_
            del kk, vv, s_, p
        return out, lse
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def env_info() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["cudnn"] = torch.backends.cudnn.version()
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    for mod in ("flash_attn_4", "sageattention"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod.replace("_", "-"))
        except Exception:
            pass
    return info


class Recorder:
    """Collects result rows, re-writing ``<out>/<name>.json`` after each so a timeout keeps them."""

    def __init__(self, out_dir: str, name: str, meta: dict):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, f"{name}.json")
        self.data = {"meta": meta, "rows": [], "notes": []}
        os.makedirs(out_dir, exist_ok=True)

    def add(self, **row):
        self.data["rows"].append(row)
        self.flush()
        return row

    def note(self, text: str):
        print("NOTE:", text, flush=True)
        self.data["notes"].append(text)
        self.flush()

    def flush(self):
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


class Deadline:
    """Wall-clock budget of a benchmark run: ``left()`` seconds remain."""

    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def guarded(rec: Recorder, what: str, fn: Callable[[], object]):
    """Run ``fn``; on an exception record it (first lines) and return None."""
    try:
        return fn()
    except Exception as exc:  # a failing candidate must not stop the run
        msg = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        rec.note(msg)
        traceback.print_exc(limit=3)
        sync()
        return None


def fmt_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Markdown table of ``rows``; ``cols`` is ``(key, header, format)``."""
    head = "| " + " | ".join(h for _, h, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, f in cols:
            v = r.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("-")
            elif f:
                cells.append(format(v, f))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
