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
