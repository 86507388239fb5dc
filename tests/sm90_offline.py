"""Compile the SM90 Gluon attention kernel for Hopper on a machine without a GPU, and read its SASS.

Triton compiles for a named target without a driver once ``get_current_target`` answers; this tool
installs a stand-in CUDA driver that names ``sm_90`` and asks for no device, builds the kernel for
each configuration and prints, per configuration: the highest register index, local-memory
spills, shared memory, an instruction census of the main key loop (one iteration of one consumer
warp) — the numbers that decide whether the loop is issue-, MUFU- or tensor-core-bound — and any
warning or performance advisory of ``ptxas -arch=sm_90a -v`` on the PTX (C7513: serialised wgmma).

    python tests/sm90_offline.py                      # default config, D=128, bf16
    python tests/sm90_offline.py --variants "default=;kblock=k_granularity:block" --sass-dir /tmp/sass
    python tests/sm90_offline.py --variants "fp16=;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct"
    python tests/sm90_offline.py --kernel block_sparse --matrix    # every constexpr combination
    python tests/sm90_offline.py --kernel block_sparse --variants "d64_fp16=head_dim:64/dtype:fp16/has_valid:false"

Besides the kernel's config keys a variant may set the build keys ``head_dim``, ``dtype`` (bf16|fp16)
and, for the block-sparse kernel, ``has_valid`` / ``return_lse`` (its other constexprs).  ``--matrix``
(block-sparse) compiles every combination of head dim 64/128, bf16/fp16, with/without padding keys,
with/without LSE, static-max/online softmax, one CTA per tile/persistent — everything a caller can
launch with the default stages — and the persistent schedule with 3 stages (68 builds).

Compile with the Triton version of the GPU machine (``GPU_TRITON``): versions differ in what Gluon
accepts (3.7.1 passes a layout read off a tensor as a call argument, 3.6.0 fails to compile it), so
a build under another version proves little — prefix ``PYTHONPATH=<a pip --target dir with
triton==3.6.0>`` or pass ``--triton-path DIR``; the tool prints the version it used and warns on a
mismatch.  Run it with ``TRITON_INTERPRET`` unset.  The SASS is disassembled with the ``cuobjdump``
that ships in Triton's wheel.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "src") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "src"))


#: the Triton version of the H200 the kernels are measured on (docs/benchmarks.md)
GPU_TRITON = "3.6.0"


def install_offline_driver(capability: int = 90) -> None:
    """Make Triton compile for ``sm_<capability>`` without a GPU (launching stays impossible)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class OfflineCuda(CudaDriver):
        def __init__(self):  # the real one loads libcuda
            pass

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        @staticmethod
        def is_active():
            return True

    triton.runtime.driver.set_active(OfflineCuda())


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(config: dict, *, head_dim: int = 128, dtype=None):
    """Build ``_sage_fwd_sm90`` for ``config`` (keys of ``sage_sm90.default_config``) on CPU stand-in
    tensors; returns Triton's compiled kernel (``.asm['cubin']``, ``.metadata``)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ditattn.attention.kernels import sage_sm90 as m

    dtype = dtype or torch.bfloat16
    cfg = m.kernel_config(head_dim, config)
    d, bn = head_dim, int(cfg["block_n"])
    b, h, hkv, sq, skv = 1, 2, 2, 256, 300
    sq_pad, skv_pad = 256, -(-skv // bn) * bn
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    nvmma = gl.NVMMASharedLayout.get_default_for
    q8 = torch.zeros(b * h * sq_pad, d, dtype=torch.int8)
    k8 = torch.zeros(b * hkv * skv_pad, d, dtype=torch.int8)
    o = torch.zeros(b, sq, h, d, dtype=dtype)
    ks = torch.zeros(b * hkv * skv_pad)
    f = torch.zeros(4096)
    qd = TensorDescriptor(q8, list(q8.shape), [d, 1], [64, d], nvmma([64, d], gl.int8))
    kd = TensorDescriptor(k8, list(k8.shape), [d, 1], [bn, d], nvmma([bn, d], gl.int8))
    if cfg["pv_dtype"] == "fp8":
        vt = torch.zeros(b * hkv * d, skv_pad, dtype=torch.float8_e4m3fn)
        vd = TensorDescriptor(vt, list(vt.shape), [skv_pad, 1], [d, bn], nvmma([d, bn], gl.float8e4nv))
    else:
        v = torch.zeros(b * skv, hkv * d, dtype=dtype)
        vd = TensorDescriptor(v, list(v.shape), [hkv * d, 1], [bn, d], nvmma([bn, d], gdt))
    od = TensorDescriptor(o, [b, sq, h * d], [sq * h * d, h * d, 1], [1, 64, d], nvmma([1, 64, d], gdt))
    ksd = TensorDescriptor(ks, [ks.numel()], [1], [bn], nvmma([bn], gl.float32))
    return m._sage_fwd_sm90.warmup(
        qd,
        kd,
        vd,
        od,
        ksd,
        f,
        f,
        f,
        f,
        f,
        f,
        f,
        o,
        f,
        sq,
        skv,
        sq_pad,
        skv_pad,
        h,
        hkv,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        sq_pad // 128 * b * h,
        **m.kernel_constexprs(cfg, d, return_lse=True, tma_store=bool(cfg["tma_store"])),
        num_warps=4,
        maxnreg=168,
        grid=(1,),
    )


def compile_block_sparse(
    config: dict, *, head_dim: int = 128, has_valid: bool = True, return_lse: bool = True, dtype=None
):
    """Build ``_bs_fwd_sm90`` (block-sparse, 64-token blocks) for ``config`` on CPU stand-in tensors,
    with the constexprs ``launch`` derives from the same call (GQA and lengths are run-time values)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ditattn.attention.kernels import block_sparse_sm90 as m

    dtype = dtype or torch.bfloat16
    cfg = m.kernel_config(head_dim, config)
    d, bs, b, h, hkv, s = head_dim, 64, 1, 2, 2, 512
    nq = s // bs
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for([bs, d], gdt)
    x = torch.zeros(b * s, h * d, dtype=dtype)
    desc = TensorDescriptor(x, list(x.shape), [h * d, 1], [bs, d], lay)
    idx = torch.zeros(b, h, nq, nq, dtype=torch.int32)
    cnt = torch.zeros(b, h, nq, dtype=torch.int32)
    f = torch.zeros(4096)
    return m._bs_fwd_sm90.warmup(
        desc,
        desc,
        desc,
        desc,
        idx,
        cnt,
        f,
        f,
        f,
        f,
        f,
        h,
        h // hkv,
        nq,
        s,
        s,
        0.1,
        idx.stride(0),
        idx.stride(1),
        idx.stride(2),
        cnt.stride(0),
        cnt.stride(1),
        0,
        0,
        (nq + 1) // 2 * b * h,
        **m.kernel_constexprs(cfg, d, dtype, has_valid=has_valid, return_lse=return_lse),
        num_warps=4,
        maxnreg=168,
        grid=(1,),
    )


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(?:\.[A-Z0-9_x.]+)?\s*([^;]*);")


def sass_of(cubin: bytes, path: str) -> str:
    with open(path, "wb") as fh:
        fh.write(cubin)
    return subprocess.run([_tool("cuobjdump"), "--dump-sass", path], capture_output=True, text=True, check=True).stdout


def ptxas_warnings(ptx: str, path: str) -> list[str]:
    """Warnings and performance advisories of ``ptxas -arch=sm_90a -v`` on the kernel's PTX (e.g.
    "(C7513) Potential Performance Loss": ptxas serialised every ``wgmma`` because a register an
    in-flight product reads is redefined before its wait)."""
    with open(path, "w") as fh:
        fh.write(ptx)
    proc = subprocess.run(
        [_tool("ptxas"), "-arch=sm_90a", "-v", path, "-o", path + ".cubin"], capture_output=True, text=True
    )
    return [
        ln.strip()
        for ln in (proc.stdout + proc.stderr).splitlines()
        if re.search(r"warning|\(C\d{4}\)|Performance Loss", ln, re.IGNORECASE)
    ]


def analyse(sass: str) -> dict:
    """Registers, spills and the census of the main key loop: the smallest backward-branch loop that
    issues both the Q.K (IGMMA, or HGMMA for bf16 Q.K) and the P.V (HGMMA; QGMMA for FP8) products."""
    ins = [(int(a, 16), op, args) for a, op, args in _INSTR.findall(sass)]
    regs = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0) + 1
    spills = sum(1 for _, op, _ in ins if op in ("LDL", "STL"))
    best = None
    for addr, op, args in ins:
        t = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            lo = int(t.group(1), 16)
            body = [o for a, o, _ in ins if lo <= a <= addr]
            gmmas = sum(1 for o in body if o in ("IGMMA", "HGMMA"))
            qk = "IGMMA" in body or gmmas >= 2 * 4  # bf16 Q.K and P.V: two groups of HGMMA
            pv = "HGMMA" in body or "QGMMA" in body
            if qk and pv and (best is None or len(body) < len(best)):
                best = body
    census = collections.Counter(best or [])
    return {
        "registers": regs,
        "spills": spills,
        "loop_instructions": sum(census.values()),
        "loop_census": dict(census.most_common()),
    }


def block_sparse_matrix() -> dict:
    """Every constexpr combination of the block-sparse kernel a caller can launch with the default stages:
    head dim, dtype, padding mask, LSE, softmax, one CTA per tile or persistent (64); plus the persistent
    schedule with 3 stages, whose head dim 128 stages the output in Q's buffer (head dim 64: in its own
    tiles, as with 2 stages), with both softmax paths (4)."""
    out = {}
    for d, dt, valid, lse, static, pers in itertools.product(
        (128, 64), ("bf16", "fp16"), (True, False), (True, False), (True, False), (False, True)
    ):
        name = (
            f"d{d}_{dt}_{'valid' if valid else 'novalid'}_{'lse' if lse else 'nolse'}_"
            f"{'static' if static else 'online'}{'_persist' if pers else ''}"
        )
        out[name] = {"head_dim": d, "dtype": dt, "has_valid": valid, "return_lse": lse, "static_max": static}
        if pers:
            out[name]["persistent"] = True
    for d, static in itertools.product((128, 64), (True, False)):
        out[f"d{d}_bf16_valid_lse_{'static' if static else 'online'}_persist_s3"] = {
            "head_dim": d,
            "has_valid": True,
            "return_lse": True,
            "static_max": static,
            "persistent": True,
            "num_stages": 3,
        }
    return out


def build_variant(kernel: str, cfg: dict, head_dim: int):
    """Compile one variant: its build keys (``head_dim``, ``dtype``, ``has_valid``, ``return_lse``) choose
    the constexprs, the rest is the kernel's config.  ValueError on an unknown value or key."""
    import torch

    cfg = dict(cfg)
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    dt = str(cfg.pop("dtype", "bf16"))
    if dt not in dts:
        raise ValueError(f"dtype {dt!r} (accepts {list(dts)})")
    kw = {"head_dim": int(cfg.pop("head_dim", head_dim)), "dtype": dts[dt]}
    if kernel == "sage":
        if "has_valid" in cfg or "return_lse" in cfg:
            raise ValueError("has_valid/return_lse are build keys of the block_sparse kernel only")
        return compile_kernel(cfg, **kw)
    for k in ("has_valid", "return_lse"):
        if k in cfg:
            kw[k] = bool(cfg.pop(k))
    return compile_block_sparse(cfg, **kw)


def _variants(spec: str) -> dict[str, dict]:
    """``name=k:v/k:v;name2=...`` -> {name: config} (the syntax of bench/sage_sm90.py's --variants)."""
    out = {}
    for part in filter(None, spec.split(";")):
        name, _, cfg = part.partition("=")
        conf = {}
        for kv in filter(None, cfg.split("/")):
            k, _, v = kv.partition(":")
            if v.lower() in ("true", "false"):
                conf[k] = v.lower() == "true"
            elif v.isdigit():
                conf[k] = int(v)
            else:
                try:
                    conf[k] = float(v)
                except ValueError:
                    conf[k] = v
        out[name] = conf
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="default=", help="'name=key:val/key:val;...' (empty = defaults)")
    ap.add_argument(
        "--matrix", action="store_true", help="block_sparse: compile every constexpr combination (replaces --variants)"
    )
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sass-dir", default=None, help="also write each variant's SASS here")
    ap.add_argument("--kernel", choices=("sage", "block_sparse"), default="sage")
    ap.add_argument(
        "--triton-path",
        default=None,
        help=f"a site-packages dir holding the GPU's Triton ({GPU_TRITON}), searched first",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object {variant: analysis} instead")
    args = ap.parse_args(argv)
    if args.matrix and args.kernel != "block_sparse":
        ap.error("--matrix is for --kernel block_sparse")
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    import triton

    if triton.__version__ != GPU_TRITON:
        print(
            f"warning: compiling with Triton {triton.__version__}, the GPU machine runs {GPU_TRITON}: what compiles "
            "here may not compile there (pass --triton-path)",
            file=sys.stderr,
        )
    install_offline_driver()
    import tempfile

    tmp = tempfile.mkdtemp()
    results = {}
    variants = block_sparse_matrix() if args.matrix else _variants(args.variants)
    if not args.json:
        print(f"Triton {triton.__version__}, sm_90a, kernel {args.kernel}")
    for name, cfg in variants.items():
        try:
            kern = build_variant(args.kernel, cfg, args.head_dim)
        except ValueError as e:  # AttentionConfigError included
            ap.error(f"variant {name}: {e}")
        sass = sass_of(kern.asm["cubin"], os.path.join(tmp, f"{name}.cubin"))
        if args.sass_dir:
            os.makedirs(args.sass_dir, exist_ok=True)
            with open(os.path.join(args.sass_dir, f"{name}.sass"), "w") as fh:
                fh.write(sass)
        a = analyse(sass)
        a["shared"] = kern.metadata.shared
        a["ptxas_warnings"] = ptxas_warnings(kern.asm["ptx"], os.path.join(tmp, f"{name}.ptx"))
        a["triton"] = triton.__version__
        results[name] = a
        if args.json:
            continue
        top = " ".join(f"{k}:{v}" for k, v in list(a["loop_census"].items())[:14])
        print(
            f"{name}: regs {a['registers']}, spills {a['spills']}, smem {kern.metadata.shared} B, "
            f"loop {a['loop_instructions']} instr/iteration [{top}]"
        )
        for w in a["ptxas_warnings"]:
            print(f"  ptxas: {w}")
    if args.json:
        import json

        print(json.dumps(results))


if __name__ == "__main__":
    main()
