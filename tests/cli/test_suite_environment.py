"""The suite writes only under its session's temporary folder (never ~/.cache), and on a machine with a
GPU the tests that assume a CPU-only machine run as on one."""

import os
import tempfile

import conftest


def test_caches_point_into_the_session_folder():
    from ditattn import settings

    root = os.path.realpath(conftest.SESSION_TMP)
    assert root.startswith(os.path.realpath(tempfile.gettempdir()))
    for var in ("HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert os.path.realpath(os.environ[var]).startswith(root), var
    if not os.environ.get("DITATTN_TEST_CACHE"):
        assert os.path.realpath(settings.cache_dir()).startswith(root)
    assert not os.path.realpath(settings.cache_dir()).startswith(os.path.realpath(os.path.expanduser("~/.cache")))


def test_built_in_models_are_built_in_the_session_folder():
    from ditattn import settings
    from ditattn.pipelines.model_index import resolve_model_path

    folder, _ = resolve_model_path("ditattn:tiny-wan")
    assert os.path.realpath(folder).startswith(os.path.realpath(settings.cache_dir()))


def test_without_a_device_aware_mark_the_test_sees_a_cpu_only_machine():
    import torch

    from ditattn.platforms import current_platform

    assert not torch.cuda.is_available() and current_platform().name == "cpu"
