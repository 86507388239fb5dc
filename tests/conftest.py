import os

# Must be set before triton or any kernel module is imported: Triton kernels run in the
# interpreter on CPU-only machines.
try:
    import torch as _torch

    _HAS_CUDA = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    _torch, _HAS_CUDA = None, False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Without a GPU: one PyTorch CPU thread in the test process and in every process it starts.  The
# tests' tensors are tiny and OpenMP threads spin-wait at barriers, so on a shared 2-core CI machine
# two threads cost 2-6x the CPU time of one (and more wall time, not less).  An OMP_NUM_THREADS in
# the environment wins.
OMP_THREADS_SET_HERE = not _HAS_CUDA and "OMP_NUM_THREADS" not in os.environ
if OMP_THREADS_SET_HERE:
    os.environ["OMP_NUM_THREADS"] = "1"
    if _torch is not None:
        _torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Everything the suite writes goes under one temporary folder, removed at the end of the session: the
# built-in models (DITATTN_CACHE, see _ditattn_model_cache), the Hugging Face cache, and the Triton /
# TorchInductor compile caches.  Set here, at import, so that code run at collection time and every
# subprocess inherit it.  DITATTN_TEST_CACHE=DIR keeps the built models across sessions instead.
import contextlib  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

SESSION_TMP = tempfile.mkdtemp(prefix="ditattn-tests-")
os.environ["DITATTN_CACHE"] = os.environ.get("DITATTN_TEST_CACHE") or os.path.join(SESSION_TMP, "ditattn")
os.environ["HF_HOME"] = os.path.join(SESSION_TMP, "huggingface")
os.environ.pop("HF_HUB_CACHE", None)
os.environ.pop("HUGGINGFACE_HUB_CACHE", None)
os.environ["TRITON_CACHE_DIR"] = os.path.join(SESSION_TMP, "triton")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(SESSION_TMP, "inductor")

import pytest  # noqa: E402

import background  # noqa: E402
import serving  # noqa: E402


def _fix_triton_kernels_to_the_interpreter() -> None:
    """Import every module that defines Triton kernels while ``TRITON_INTERPRET=1``: ``@triton.jit`` decides at
    decoration time whether a kernel is interpreted, so a module first imported inside a test that sets
    ``TRITON_INTERPRET=0`` (to check the CPU refusal) would leave compiled-only kernels to every later test in
    the process, and the interpreter tests would pass or fail with the order tests run in."""
    import importlib
    import pkgutil

    try:
        import ditattn.attention.kernels as kernels
    except ImportError:  # pragma: no cover
        return
    names = [f"{kernels.__name__}.{m.name}" for m in pkgutil.iter_modules(kernels.__path__)]
    for name in names + ["ditattn.models.fp8_linear", "ditattn.models.fused"]:
        try:
            importlib.import_module(name)
        except ImportError:  # a kernel module whose own dependency is absent here: its tests skip
            pass


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_triton_kernels_to_the_interpreter()


def pytest_unconfigure(config):
    BACKGROUND.stop()  # a run still going when the session ended early
    serving.wait_stopped()  # servers stopped by the tests, still shutting down
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


#: test modules written for either kind of machine (their GPU cases skip without CUDA, their CPU cases
#: pick the device themselves): the CPU-machine pinning below leaves them alone
DEVICE_AWARE_MODULES = {
    "test_gpu_kernels",
    "test_sage_sm90",
    "test_block_sparse_sm90",
    "test_sage_balance",
    "test_triton_interp",
    "test_bench_fp8_quant_kernel",
    "test_bench_dit_quant",
    "test_bench_gather_floor",
}
_GPU_WORDS = ("cuda", "gpu", "sm90", "hopper")


def _device_aware(item) -> bool:
    module = getattr(getattr(item, "module", None), "__name__", "")
    if item.get_closest_marker("gpu") is not None or module.rpartition(".")[2] in DEVICE_AWARE_MODULES:
        return True
    return any(
        any(w in str(m.kwargs.get("reason", "")).lower() for w in _GPU_WORDS) for m in item.iter_markers("skipif")
    )


@contextlib.contextmanager
def _as_cpu_machine():
    """PyTorch reports no CUDA device, the platform in force is the CPU, subprocesses start with
    ``CUDA_VISIBLE_DEVICES=""``; on leaving, PyTorch's cached "is Triton usable" answers (computed while
    CUDA looked absent) are dropped so that the next GPU test compiles."""
    import torch

    from ditattn.platforms import Platform, use_platform

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "is_available", lambda: False)
            mp.setattr(torch.cuda, "device_count", lambda: 0)
            mp.setenv("CUDA_VISIBLE_DEVICES", "")
            with use_platform(Platform("cpu", "cpu")):
                yield
    finally:
        _forget_triton_probes()  # once the patches are undone


def _forget_triton_probes():
    import torch.utils._triton as triton_probes

    for fn in vars(triton_probes).values():
        if callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def _cpu_machine_module(request):
    """A module none of whose tests is device-aware runs as on a CPU-only machine for its whole life, so
    that its module-scoped fixtures (a loaded pipeline, a running server) are built that way too."""
    if not _HAS_CUDA or request.module.__name__ in _MODULES_WITH_DEVICE_AWARE_TESTS:
        yield
        return
    with _as_cpu_machine():
        yield


#: the modules that hold at least one device-aware test (filled once the session's tests are collected)
_MODULES_WITH_DEVICE_AWARE_TESTS: set = set()


def pytest_collection_modifyitems(config, items):
    _MODULES_WITH_DEVICE_AWARE_TESTS.update(
        item.module.__name__ for item in items if getattr(item, "module", None) is not None and _device_aware(item)
    )
    # the tests that read the offline SM90 census run last (a stable sort: the others keep their order), so that
    # the census, compiled in the background once collection ends (pytest_collection_finish), is ready by then
    items.sort(key=lambda item: item.get_closest_marker("sm90_census") is not None)


@pytest.fixture(autouse=True)
def _cpu_machine(request):
    """The suite's expectations are a CPU-only machine's (the automatic DiT backend torch_sdpa, fa running
    torch_sdpa, --num-gpus refused, no CUDA peak memory).  On a machine with a GPU every test that is not
    device-aware (marker ``gpu``, a module of :data:`DEVICE_AWARE_MODULES`, or a skipif naming CUDA /
    a GPU) runs as on a CPU-only machine (:func:`_as_cpu_machine`).  Without a GPU this changes nothing."""
    if not _HAS_CUDA or _device_aware(request.node):
        yield
        return
    with _as_cpu_machine():
        yield


@pytest.fixture(autouse=True)
def _no_force_leak():
    """A test that forces a backend must not leak it into the next test."""
    from ditattn.attention.context import _forced

    before = _forced[0]
    yield
    _forced[0] = before


@pytest.fixture(scope="session", autouse=True)
def _ditattn_model_cache():
    """The built-in tiny models (``ditattn:tiny-wan``, ``ditattn:tiny-wan2.2``) are built once per
    test session into the session's temporary folder (never the user's ~/.cache); subprocesses inherit
    it.  ``DITATTN_TEST_CACHE=DIR`` reuses DIR across sessions (faster local iteration)."""
    yield os.environ["DITATTN_CACHE"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "sm90_census(kernel, variants): the test reads the offline SM90 census of "
        "these kernel variants through the ``sm90_census`` fixture",
    )
    config.addinivalue_line("markers", "gpu: the test picks its device itself (not pinned to a CPU-only machine)")
    config.addinivalue_line("markers", "ray: starts a local Ray instance (select with -m ray)")
    config.addinivalue_line(
        "markers",
        "background(spec): the test's subprocess runs in the background while the suite runs (tests/background.py); "
        "the test reads it through the ``background_run`` fixture",
    )


_CENSUS_DRIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sm90_offline
for kernel, variants in json.loads(sys.argv[2]):
    sm90_offline.main(["--kernel", kernel, "--variants", variants, "--json", *json.loads(sys.argv[3])])
"""


def _census_wanted(items) -> list:
    return sorted({tuple(m.args) for item in items for m in item.iter_markers("sm90_census")})


def _sm90_census_run(wanted: list):
    """The background run (tests/background.py) that compiles every census in ``wanted`` ([(kernel,
    variants)]) in ONE fresh interpreter without the Triton interpreter (tests/sm90_offline.py).
    ``DITATTN_SM90_TRITON_PATH`` (a site-packages dir holding the GPU machine's Triton, 3.6.0) compiles with
    that version instead of the installed one."""
    import json
    import sys

    def spec(folder):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.path.join(root, "src") + os.pathsep + env.get("PYTHONPATH", "")
        triton_path = os.environ.get("DITATTN_SM90_TRITON_PATH")
        extra = ["--triton-path", triton_path] if triton_path else []
        args = [sys.executable, "-c", _CENSUS_DRIVER, os.path.join(root, "tests"), json.dumps(wanted)]
        return dict(args=[*args, json.dumps(extra)], env=env, timeout=900)

    return ("sm90_census", tuple(wanted)), spec


#: the session's background runs (tests/background.py)
BACKGROUND = background.Runner(os.path.join(SESSION_TMP, "background"))


def pytest_collection_finish(session):
    """Queue the SM90 census, then the subprocesses of the selected tests marked ``background`` (in the order
    the tests run), and start running them.  The census, by far the longest (~80 s of one core), goes first:
    it then compiles while the suite's first tests run in this process alone, not while later ones run
    several processes (ranks, servers) that it would slow down; its tests run last
    (pytest_collection_modifyitems)."""
    if session.config.option.collectonly:
        return
    wanted = _census_wanted(session.items)
    if wanted:
        BACKGROUND.add(*_sm90_census_run(wanted))
    for item in session.items:
        if item.get_closest_marker("background") is not None:
            BACKGROUND.add(*_background_spec(item))
    BACKGROUND.start()


@pytest.fixture
def background_run(request) -> tuple:
    """``(subprocess.CompletedProcess, folder)`` of the test's ``@pytest.mark.background.with_args(spec)`` run
    (tests/background.py): run while the suite ran, or now if it had not started."""
    assert request.node.get_closest_marker("background") is not None, "background_run needs @pytest.mark.background"
    proc, folder = BACKGROUND.result(*_background_spec(request.node))
    return proc, pathlib.Path(folder)


def _background_spec(item) -> tuple:
    """``(key, spec)`` of the test's ``background`` mark; on a machine with a GPU a test that is not device-aware
    gets the environment of a CPU-only machine's subprocesses (``CUDA_VISIBLE_DEVICES=""``: :func:`_as_cpu_machine`),
    as the run has started before the test."""
    spec = item.get_closest_marker("background").args[0]
    if not _HAS_CUDA or _device_aware(item):
        return spec, spec

    def on_a_cpu_machine(folder):
        kw = dict(spec(folder))
        kw["env"] = {**(kw.get("env") or os.environ), "CUDA_VISIBLE_DEVICES": ""}
        return kw

    return (spec, "cpu"), on_a_cpu_machine


@pytest.fixture(scope="session")
def _sm90_census_all(request) -> dict:
    """Every census the session's ``sm90_census`` markers ask for (:func:`_sm90_census_run`, compiled in the
    background while the other tests ran): ``{(kernel, variants): {variant: registers, spills, shared, loop
    census}}``."""
    import json

    wanted = _census_wanted(request.session.items)
    proc, _ = BACKGROUND.result(*_sm90_census_run(wanted))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-len(wanted) :]
    return {pair: json.loads(line) for pair, line in zip(wanted, lines)}


@pytest.fixture
def sm90_census(request, _sm90_census_all) -> dict:
    """The offline SM90 census (``{variant: registers, spills, shared, loop census}``) of the test's
    ``@pytest.mark.sm90_census(kernel, variants)``."""
    marker = request.node.get_closest_marker("sm90_census")
    assert marker is not None, "sm90_census needs @pytest.mark.sm90_census(kernel, variants)"
    return _sm90_census_all[tuple(marker.args)]


@pytest.fixture
def run_bench(monkeypatch, capsys):
    """``run_bench("fidelity.py", *argv, env={...})`` runs ``python bench/fidelity.py argv`` in this
    process (as ``__main__``, with ``env`` set and a fresh import of bench/common.py, which reads
    BENCH_DEVICE) and returns what it printed to stdout; a non-zero exit fails the test.  The CPU
    smoke runs of the benchmarks then share the session's imports (torch, diffusers, ...) instead of
    paying seconds per script for them in a fresh interpreter."""
    import runpy
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

    def run(script: str, *argv: str, env: dict | None = None) -> str:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        for name in ("common", "e2e"):  # bench modules that scripts import by these names
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.syspath_prepend(bench)
        path = os.path.join(bench, script)
        monkeypatch.setattr(sys, "argv", [path, *argv])
        capsys.readouterr()
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            captured = capsys.readouterr()
            assert exc.code in (0, None), f"{script}: exit {exc.code}\n{captured.out[-2000:]}{captured.err[-3000:]}"
            return captured.out
        return capsys.readouterr().out

    return run


@pytest.fixture(scope="session")
def pg_server():
    """A throwaway PostgreSQL server for the session (tests/pg.py); skips when PostgreSQL or psycopg
    is not installed."""
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")
    from pg import PgServer, find_bin

    bindir = find_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (initdb not found; Debian: apt-get install postgresql)")
    server = PgServer(bindir).start()
    yield server
    server.stop()
