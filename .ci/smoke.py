"""Smoke test of an installed ditattn (run by .ci/floors against the declared lowest versions; runs
against any install): the console script, every command on the built-in tiny model on the CPU, the
Python pipeline, the diffusers integration and one request to a real ``ditattn serve``.

Usage: ``HF_HUB_OFFLINE=1 python .ci/smoke.py`` from any directory but the source tree (so the
installed package is what runs).  Prints one line per check; exits non-zero on the first failure.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

OUT = tempfile.mkdtemp(prefix="ditattn-smoke-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DITATTN_CACHE", os.path.join(OUT, "cache"))
EXE = shutil.which("ditattn") or sys.exit("the ditattn console script is not on PATH")
SMALL = ["--height", "32", "--width", "48", "--num-inference-steps", "2"]


def check(what, ok, detail="", info=""):
    """Print ``ok`` with ``info``, or ``FAIL`` with ``detail`` (e.g. the command's stderr) and stop."""
    note = info if ok else detail
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + note if note else ''}", flush=True)
    if not ok:
        sys.exit(1)


def cli(*argv, timeout=600):
    return subprocess.run([EXE, *argv], capture_output=True, text=True, timeout=timeout)


def main():
    import ditattn

    check(
        "ditattn imports from the install, not a checkout",
        "site-packages" in ditattn.__file__ or os.environ.get("SMOKE_ALLOW_SOURCE") == "1",
        ditattn.__file__,
        ditattn.__file__,
    )
    best = min(_timed(EXE, "--help") for _ in range(3))
    check("ditattn --help under 1 s", best < 1.0, f"{best:.2f} s", f"{best:.2f} s")

    proc = cli("backends", "--json")
    check("ditattn backends", proc.returncode == 0 and "torch_sdpa" in proc.stdout, proc.stderr[-300:])
    proc = cli("plan", "--attention-backend", "video_sparse_attn")
    check("ditattn plan", proc.returncode == 0 and "video_sparse_attn" in proc.stdout, proc.stderr[-300:])
    proc = cli(
        "generate",
        "--prompt",
        "a red fox",
        "--num-frames",
        "5",
        "--output-path",
        OUT,
        "--output-file",
        "fox.mp4",
        *SMALL,
    )
    check(
        "ditattn generate (MP4)",
        proc.returncode == 0 and os.path.getsize(os.path.join(OUT, "fox.mp4")) > 0,
        proc.stderr[-300:],
    )
    proc = cli(
        "generate",
        "--prompt",
        "a red fox",
        "--num-frames",
        "1",
        "--backend",
        "diffusers",
        "--attention-backend",
        "torch_sdpa",
        "--output-path",
        OUT,
        "--output-file",
        "stock.png",
        *SMALL,
    )
    check(
        "ditattn generate --backend diffusers (ditattn attention)",
        proc.returncode == 0 and "(ditattn in diffusers)" in proc.stdout,
        proc.stderr[-300:],
    )
    proc = cli("plan", "--backend", "diffusers", "--attention-backend", "video_sparse_attn", "--json")
    check(
        "ditattn plan --backend diffusers",
        proc.returncode == 0 and json.loads(proc.stdout)["pipeline"] == "diffusers",
        proc.stderr[-300:],
    )
    proc = cli(
        "generate",
        "--prompt",
        "a red fox",
        "--num-frames",
        "1",
        "--attention-backend",
        "sage_attn",
        "--attention-backend-config",
        "impl=reference,pv_dtype=fp8",
        "--dtype",
        "bfloat16",
        "--skip-softmax-threshold-scale-factor",
        "0.5",
        "--output-path",
        OUT,
        *SMALL,
    )
    check("CPU reference paths without Triton (sage_attn, skip softmax)", proc.returncode == 0, proc.stderr[-300:])
    proc = cli("generate", "--prompt", "x", "--attention-backend", "nope")
    check(
        "a bad flag is one error line, exit 2",
        proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.strip().count("\n") == 0,
        proc.stderr[-300:],
    )

    pipe = ditattn.WanPipeline.from_pretrained("ditattn:tiny-wan", attention_backend="torch_sdpa", dtype="float32")
    frames = pipe("a red fox", num_frames=5, height=32, width=48, num_inference_steps=2, progress=False)
    path = ditattn.save_video(frames, os.path.join(OUT, "python.mp4"))
    check("ditattn.WanPipeline + save_video", frames.shape == (1, 5, 32, 48, 3) and os.path.isfile(path))

    import torch
    from diffusers import WanPipeline

    from ditattn.integrations import diffusers as dd

    stock = WanPipeline.from_pretrained(pipe.native.model_index.path, dtype=torch.float32)
    stock.set_progress_bar_config(disable=True)
    kw = dict(prompt="a fox", height=32, width=48, num_frames=1, num_inference_steps=2, output_type="latent")
    ref = stock(**kw, generator=torch.Generator("cpu").manual_seed(0)).frames
    dd.apply(stock, attention_backend="torch_sdpa")
    out = stock(**kw, generator=torch.Generator("cpu").manual_seed(0)).frames
    check("integrations.diffusers.apply(torch_sdpa) leaves the output exact", torch.equal(ref, out))

    _serve()
    print(f"smoke test passed ({OUT})")


def _timed(*cmd):
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return time.perf_counter() - t0


def _serve():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(OUT, "serve.log"), "w")
    proc = subprocess.Popen(
        [EXE, "serve", "--port", str(port), "--num-inference-steps", "2"], stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                check("ditattn serve keeps running", False, open(log.name).read()[-500:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 300:
                check("ditattn serve comes up within 300 s", False, open(log.name).read()[-500:])
            time.sleep(0.5)
        check("ditattn serve comes up", True, info=f"{time.time() - t0:.0f} s")
        body = json.dumps({"prompt": "a boat", "size": "32x32"}).encode()
        req = urllib.request.Request(
            base + "/v1/images/generations", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        check(
            "ditattn serve answers an image request",
            len(answer["data"]) == 1 and answer["attention_backends"],
            str(answer),
            str(answer.get("attention_backends")),
        )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
