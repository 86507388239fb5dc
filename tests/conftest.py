import os

# Must be set before triton or any kernel module is imported: Triton kernels run in the
# interpreter on CPU-only machines (NOTES.md).
try:
    import torch as _torch

    _HAS_CUDA = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_force_leak():
    """A test that forces a backend must not leak it into the next test."""
    from ditattn.attention.context import _forced

    before = _forced[0]
    yield
    _forced[0] = before


@pytest.fixture(scope="session", autouse=True)
def _ditattn_model_cache(tmp_path_factory):
    """The built-in tiny models (``ditattn:tiny-wan``, ``ditattn:tiny-wan2.2``) are built once per
    test session into a temporary cache (never the user's ~/.cache); subprocesses inherit it.
    ``DITATTN_TEST_CACHE=DIR`` reuses DIR across sessions (faster local iteration)."""
    path = os.environ.get("DITATTN_TEST_CACHE") or str(tmp_path_factory.mktemp("ditattn-cache"))
    old = os.environ.get("DITATTN_CACHE")
    os.environ["DITATTN_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("DITATTN_CACHE", None)
    else:
        os.environ["DITATTN_CACHE"] = old


def sm90_offline_census(kernel: str, variants: str) -> dict:
    """Compile an SM90 Gluon kernel for Hopper without a GPU (bench/sm90_offline.py, in a fresh
    interpreter without the Triton interpreter) and return ``{variant: registers, spills, shared,
    loop census}``.  ``DITATTN_SM90_TRITON_PATH`` (a site-packages dir holding the GPU machine's
    Triton, 3.6.0) compiles with that version instead of the installed one."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(root, "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(root, "bench", "sm90_offline.py"), "--kernel", kernel, "--variants", variants,
           "--json"]
    if os.environ.get("DITATTN_SM90_TRITON_PATH"):
        cmd += ["--triton-path", os.environ["DITATTN_SM90_TRITON_PATH"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
