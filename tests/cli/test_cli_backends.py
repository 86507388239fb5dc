"""`ditattn backends` and the CLI's error contract (one `error:` line, exit 2, no traceback)."""

import json
import subprocess
import sys

import pytest
import torch

from ditattn.attention.names import AttentionBackendEnum
from ditattn.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "ditattn", *args], capture_output=True, text=True, timeout=120)


def test_backends_json_lists_every_backend_with_reasons(capsys):
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {b["name"]: b for b in data["backends"]}
    assert set(names) == {m.value for m in AttentionBackendEnum}
    assert names["fa"]["aliases"] == ["fa3", "fa4"]
    assert names["torch_cudnn_sdpa"]["aliases"] == ["cudnn_sdpa"]
    sdpa = names["torch_sdpa"]
    assert sdpa["usable_here"] and sdpa["enum"] == "TORCH_SDPA" and sdpa["kind"] == "dense"
    for n in ("laser_attn", "aiter", "sage_attn_3", "video_sparse_attn_h3"):
        assert not names[n]["usable_here"] and names[n]["reasons"], n
    sta = {p["name"]: p for p in names["sliding_tile_attn"]["params"]}
    assert sta["skip_time_steps"]["default"] == 15 and sta["mask_strategy_file_path"]["required"]


def test_backends_table(capsys):
    assert main(["backends", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert (
        "fa (fa3, fa4)" in out
        and "needs an Ascend NPU" in out
        and "falls back here to torch_sdpa" in out
        and "param topk: float = 0.5" in out
    )


def _here(info) -> str:
    """The listing's "here" statement, from the capability data: a backend that runs here in only some
    of --dtype's choices says which."""
    if not info.usable_here:
        return "no"
    if {"float32", "bfloat16", "float16"} <= set(info.dtypes):
        return "yes"
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    return f"yes, {'/'.join(short[d] for d in sorted(info.dtypes))} only"


def test_backends_short_form_is_one_line_per_backend(capsys):
    """Plain ``backends``: a header, one line per backend (name, kind, here, a short why-not), a hint."""
    from ditattn.platforms import Platform, use_platform
    from ditattn.registry import list_backends

    with use_platform(Platform.simulate("cuda", (9, 0), ["triton"])):
        assert main(["backends"]) == 0
        infos = {i.name: i for i in list_backends()}
    lines = capsys.readouterr().out.splitlines()
    rows = lines[2:-1]
    assert len(rows) == len(AttentionBackendEnum) and "NAME" in lines[-1]
    for row in rows:
        name = row.split()[0]
        info = infos[name]
        assert row[31:48].strip() == info.kind and len(row) <= 140, row
        here = row[49:].split("  ")[0]
        assert here == _here(info), row
        assert "param " not in row
    fa = next(r for r in rows if r.startswith("fa "))
    assert "runs torch_sdpa instead" in fa  # the substitution, in a few words
    s3 = next(r for r in rows if r.startswith("sage_attn_3 "))
    assert "SM100" in s3  # the first reason


def test_backends_here_names_a_dtype_restriction_consistently(capsys):
    """On the CPU sparge_attn and sol_attn refuse float32: "yes" alone would claim more than is true.
    The short listing, ``backends NAME`` and ``--verbose`` say the same, and what they say is what the
    backend's capability check accepts."""
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.attention.specs import SPECS, LayerRequest
    from ditattn.platforms import Platform, use_platform
    from ditattn.registry import list_backends

    with use_platform(Platform.simulate("cpu")):
        assert main(["backends"]) == 0
        short = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[2:-1]}
        assert main(["backends", "--verbose"]) == 0
        verbose = capsys.readouterr().out.splitlines()
        infos = list_backends()
        plat = Platform.simulate("cpu")
    assert short["sparge_attn"].endswith("  yes, bf16/fp16 only"), short["sparge_attn"]
    assert short["sol_attn"].endswith("  yes, bf16 only"), short["sol_attn"]
    assert short["torch_sdpa"].endswith("  yes"), short["torch_sdpa"]
    header, sparge = verbose[1], next(ln for ln in verbose if ln.startswith("sparge_attn "))
    col = header.index("here")  # the column holds the longest statement, the platforms stay aligned
    assert sparge[col:].startswith("yes, bf16/fp16 only ") and sparge.index("cuda,cpu") == header.index("platforms")
    for info in infos:
        row = next(ln for ln in verbose if ln.split()[:1] == [info.name])
        after_kind = row.split(f" {info.kind} ", 1)[1].lstrip()
        assert after_kind.startswith(_here(info) + " "), row  # the same statement, the platforms after it
        assert short[info.name][49:].startswith(_here(info)), short[info.name]
        if info.usable_here:  # every dtype the statement leaves out is one the capability check refuses
            for dt, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
                refused = any("dtype" in r for r in SPECS[B(info.name)].reasons(LayerRequest(dtype=dt), plat))
                assert refused == (name not in info.dtypes), (info.name, name)
    with use_platform(Platform.simulate("cpu")):
        assert main(["backends", "sparge_attn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split("  ")[0] == "sparge_attn" and "  yes, bf16/fp16 only  cuda,cpu  [" in lines[2], lines[2]


def test_backends_name_shows_one_backend_in_full(capsys):
    assert main(["backends", "sage-attn"]) == 0
    out = capsys.readouterr().out
    assert "param impl: str = 'auto'" in out and "param topk" not in out
    assert out.count("quantized") == 1
    assert main(["backends", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown attention backend 'nope'")


def test_version():
    from importlib.metadata import PackageNotFoundError, version

    import ditattn

    try:
        expected = version("ditattn")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed: the package's own
        expected = ditattn.__version__
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ditattn {expected}"


def test_cli_user_errors_are_one_line_exit_2():
    r = run("backends", "--nope")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = run("backends", "--enable-attention-backend-autotune", "maybe")
    assert r.returncode == 2 and "expected true or false" in r.stderr


def test_python_dash_m_and_help():
    r = run("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "backends" in r.stdout


def test_backends_validates_attention_flags_instead_of_ignoring_them(capsys):
    assert main(["backends", "--attention-backend", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown attention backend 'nope'")
    assert main(["backends", "--attention-backend-config", "foo=1"]) == 2
    assert "config key(s) 'foo' belong to no backend" in capsys.readouterr().err
    assert main(["backends", "--attention-backend", "fa", "--attention-backend-config", "sparsity=0.5"]) == 2
    assert "config key(s) 'sparsity' belong to no backend in use" in capsys.readouterr().err  # as plan says
    assert (
        main(["backends", "--attention-backend", "video_sparse_attn", "--attention-backend-config", "sparsity=0.5"])
        == 0
    )
    err = capsys.readouterr().err
    assert err.startswith("note: --attention-backend, --attention-backend-config checked") and err.count("\n") == 1


def test_serve_flag_errors_before_loading_the_model(capsys):
    import socket

    with pytest.raises(SystemExit) as ei:  # argparse-level error
        main(["serve", "--port", "99999"])
    assert ei.value.code == 2 and "expected a TCP port 1-65535" in capsys.readouterr().err
    assert main(["serve", "--seed", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: --seed does not apply to serve")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


def test_backends_name_the_measured_operating_points_of_sparse_defaults(capsys):
    """Every sparse backend's defaults carry their measured (error, speed) operating point."""
    from ditattn.attention.operating_points import OPERATING_POINTS

    assert main(["backends", "--json"]) == 0
    names = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    for n in ("sparge_attn", "sparse_video_gen_2_attn", "sol_attn", "vmoba_attn", "video_sparse_attn"):
        op = names[n]["operating_point"]
        assert op is not None and 0 <= op["rel_err"] < 2 and 0 < op["kept"] <= 1, n
        assert op["speedup"] is not None or "bench/fidelity.py" in op["speed_pending"]
    # every training-free default measured on the H200 at both head counts, none slower than dense
    for n in ("sparge_attn", "sparse_video_gen_2_attn", "sol_attn", "vmoba_attn", "sliding_tile_attn"):
        op = names[n]["operating_point"]
        assert op["speedup"] >= 1.0 and op["speedup_40"] >= 1.0, n
        assert op["rel_err_12"] is not None and op["rel_err_40"] is not None, n
    assert names["torch_sdpa"]["operating_point"] is None
    assert main(["backends", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert (
        "measured at defaults (topk 0.5, pooled-query predictor, INT8 Q.K in kept blocks, packed edge tiles) on "
        "structured 480p inputs"
    ) in out
    assert "H200 vs FA4 dense: 12 heads 2.05x at 5.1 % error, 40 heads 2.12x at 3.7 % error" in out  # sol_attn
    assert len(OPERATING_POINTS) >= 5


def test_backends_leaves_the_sigpipe_handler_alone():
    """``backends`` run in a process that also serves (or runs tests that write to closed sockets) must not
    make a broken pipe fatal for that whole process: Python's handler stays in place."""
    import signal

    from ditattn.entrypoints.cli import main

    before = signal.getsignal(signal.SIGPIPE)
    assert main(["backends"]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before


def _backends_into_head(folder):
    return dict(args=f"{sys.executable} -m ditattn backends --verbose | head -1", shell=True, timeout=120)


@pytest.mark.background.with_args(_backends_into_head)
def test_backends_into_a_closed_pipe_is_quiet(background_run):
    r, _ = background_run
    assert r.returncode == 0 and r.stdout.startswith("platform:") and "Traceback" not in r.stderr, r.stderr
