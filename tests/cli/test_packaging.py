"""Packaging: the console script starts without torch (``ditattn --help`` under a second), the public
names load on first use, a missing optional dependency is one line naming its extra, every declared
dependency has a floor (``.ci/floors`` installs exactly those), ``py.typed`` ships."""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

import serving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = serving.subprocess_env()
HEAVY = ("torch", "diffusers", "transformers", "numpy", "fastapi")


def test_help_imports_nothing_heavy_and_is_fast():
    probe = (
        "import sys, runpy; sys.argv = ['ditattn', '--help']\n"
        "try:\n    runpy.run_module('ditattn', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=60).stdout
    assert "generate" in out and out.strip().splitlines()[-1] == "HEAVY []"
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "ditattn", "generate", "--help"],
            capture_output=True,
            env=ENV,
            check=True,
            timeout=60,
        )
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"ditattn generate --help took {best:.2f} s"


def _public_names_probe(folder):
    probe = (
        "import sys, ditattn; assert 'torch' not in sys.modules\n"
        "assert callable(ditattn.attention) and ditattn.WanPipeline.__name__ == 'WanPipeline'\n"
        "assert ditattn.AttentionBackendEnum.from_name('fa4').value == 'fa'\n"
        "assert set(ditattn.__all__) <= set(dir(ditattn))\n"
        "import ditattn.attention.selector as s; print(s.__name__)"
    )
    return dict(args=[sys.executable, "-c", probe], env=ENV, timeout=120)


@pytest.mark.background.with_args(_public_names_probe)
def test_public_names_load_on_first_use(background_run):
    proc, _ = background_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import ditattn

        ditattn.nope  # noqa: B018


def test_missing_server_extra_is_one_line(monkeypatch, capsys):
    from ditattn import extras
    from ditattn.cli import main

    real = extras._installed
    monkeypatch.setattr(extras, "_installed", lambda m: m not in ("fastapi", "uvicorn") and real(m))
    assert extras.missing("server") == ["fastapi", "uvicorn"]
    with pytest.raises(ImportError, match=r"install ditattn\[server\]"):
        extras.require("server", "the ditattn server")
    capsys.readouterr()
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ditattn serve needs fastapi, uvicorn, which are not installed; install ditattn[server]")
        and err.count("\n") == 1
    )


def test_every_dependency_has_a_floor_and_py_typed_ships():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    project = meta["project"]
    for req in project["dependencies"] + project["optional-dependencies"]["server"]:
        assert re.match(r"^[A-Za-z0-9_.\-]+>=[0-9]", req.split(";")[0].replace(" ", "")), req
    assert "accelerate" in " ".join(project["dependencies"]) and "huggingface_hub" in " ".join(project["dependencies"])
    assert "ftfy" in " ".join(project["dependencies"])  # diffusers' Wan pipelines call it unguarded (a NameError)
    assert meta["tool"]["setuptools"]["package-data"]["ditattn"] == ["py.typed"]
    assert os.path.isfile(os.path.join(ROOT, "src", "ditattn", "py.typed"))
    # the CI pins satisfy the floors
    pins = dict(
        line.split("==")
        for line in open(os.path.join(ROOT, "requirements-ci.txt"))
        if "==" in line and not line.startswith("#")
    )
    pins = {k.lower().replace("_", "-"): v.strip() for k, v in pins.items()}
    for req in project["dependencies"]:
        name, floor = req.split(";")[0].replace(" ", "").split(">=")
        pin = pins.get(name.lower().replace("_", "-"))
        if pin is not None:
            assert _version(pin) >= _version(floor), f"{name}: pinned {pin} below the floor {floor}"


def _version(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def _mypy_run(folder):
    tmp_path = pathlib.Path(folder)
    snippet = tmp_path / "use.py"
    snippet.write_text(
        "import torch\nimport ditattn\n\nq = torch.randn(1, 8, 2, 16)\n"
        "out: torch.Tensor = ditattn.attention(q, q, q, backend='torch_sdpa')\n"
        "ditattn.attention(q, q, q, bakend='torch_sdpa')\n"
        "pipe = ditattn.WanPipeline.from_pretrained('ditattn:tiny-wan', attention_backend='fa')\n"
    )
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = silent\n\n[mypy-torch.*]\nfollow_imports = skip\n")
    env = dict(os.environ, MYPYPATH=os.path.join(ROOT, "src"))
    return dict(
        args=[
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            str(snippet),
        ],
        env=env,
        timeout=600,
    )


@pytest.mark.background.with_args(_mypy_run)
def test_type_checkers_see_the_attention_function(background_run):
    """``ditattn.attention`` is the typed function to mypy (and the package is ``py.typed``): a
    misspelt keyword is a type error.  mypy skips torch's own ~1400 modules (15 s of a 2-core CI run;
    ``torch.Tensor`` is then ``Any``, which changes nothing here: the function's return is
    unannotated and the call passes tensors where tensors are expected)."""
    pytest.importorskip("mypy")
    proc, _ = background_run
    errors = [l for l in proc.stdout.splitlines() if ": error:" in l]
    assert len(errors) == 1 and 'Unexpected keyword argument "bakend" for "attention"' in errors[0], proc.stdout


def test_torchao_compile_time_syntax_warnings_are_quiet_after_import():
    """Python 3.12+ compiling torchao's sources without cached bytecode warns about escape sequences in its docstrings
    (seen on a GPU machine whose packages were installed with --no-compile); after ``import ditattn`` such a warning
    attributed to a torchao file is dropped, one from any other file still shows."""
    probe = (
        "import warnings, ditattn\n"
        "for path in ('/site/torchao/quantization/quant_api.py', '/site/other/mod.py'):\n"
        "    warnings.warn_explicit(\"invalid escape sequence '\\\\.'\", SyntaxWarning, path, 3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchao" not in proc.stderr and "/site/other/mod.py:3: SyntaxWarning" in proc.stderr


def _import_probe(folder):
    probe = (
        "import logging, ditattn, diffusers\n"
        "from diffusers import AutoencoderKLWan\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('torchao'):\n"
        "    import torchao.quantization\n"
        "log = logging.getLogger('torchao')\n"
        "log.warning('Skipping import of cpp extensions due to incompatible torch version')\n"
        "log.warning('another torchao message')\n"
    )
    return dict(args=[sys.executable, "-c", probe], env=ENV, timeout=300)


@pytest.mark.background.with_args(_import_probe)
def test_import_prints_no_third_party_notices(background_run):
    """``import ditattn`` and the imports it leads to (diffusers, torchao) print nothing: torchao's notice
    that it skips its C++ extensions (unused here) is dropped, its other log records pass."""
    proc, _ = background_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip() == "another torchao message"
