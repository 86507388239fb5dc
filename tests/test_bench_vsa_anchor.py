"""bench/vsa_anchor.py (the upstream fastvideo-kernel anchor; it runs on the H200): its flags, the one error line
and build-log tail when the package was not built, and its adapter to upstream's layout, checked on CPU against
a PyTorch stand-in with upstream's calling convention."""
import math
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
vsa_anchor = pytest.importorskip("vsa_anchor")


@pytest.fixture
def clean_imports(monkeypatch):
    """load_upstream puts --site on sys.path and imports fastvideo_kernel: undo both."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.split(".")[0] == "fastvideo_kernel"]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "fastvideo_kernel"]:
        del sys.modules[name]


def test_flags():
    a = vsa_anchor.parse_args([])
    assert (a.seq_list, a.sparsity_list, a.heads, a.upstream_list) == ([32760, 75600], [0.9, 0.85, 0.95], 40, ["tk"])
    a = vsa_anchor.parse_args(["--seqs", "1000", "--sparsities", "0.5,0", "--upstream", "tk,tk_layout,triton"])
    assert (a.seq_list, a.sparsity_list, a.upstream_list) == ([1000], [0.5, 0.0], ["tk", "tk_layout", "triton"])
    for bad in (["--seqs", "x"], ["--seqs", "0"], ["--sparsities", "1.2"], ["--upstream", "cute"],
                ["--upstream", ""], ["--heads", "0"]):
        with pytest.raises(SystemExit) as ei:
            vsa_anchor.parse_args(bad)
        assert ei.value.code == 2, bad


def test_the_session_scripts_call_it_with_its_flags():
    """bench/h200_session*.sh's vsa_anchor.py calls use flags the script has; the shell scripts parse."""
    import re
    import subprocess

    bench = os.path.join(os.path.dirname(__file__), "..", "bench")
    known = vsa_anchor.build_parser()._option_string_actions
    calls = 0
    for name in sorted(os.listdir(bench)):
        if name.endswith(".sh"):
            text = open(os.path.join(bench, name)).read()
            for m in re.finditer(r"python3 bench/vsa_anchor\.py((?:\\\n|[^\n])*)", text):
                calls += 1
                flags = re.findall(r"(?<![\w-])--[a-z][a-z-]*", m.group(1))
                assert flags and all(f in known for f in flags), (name, flags)
    assert calls >= 1
    assert subprocess.run(["bash", "-n", os.path.join(bench, "h200_session21.sh")]).returncode == 0


def test_not_built_is_one_error_line_then_the_build_log_tail(tmp_path, capsys, clean_imports):
    log = tmp_path / "vsa_build.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "nvcc fatal   : boom\n")
    out_dir = tmp_path / "out"
    assert vsa_anchor.main(["--site", str(tmp_path / "site"), "--build-log", str(log), "--out", str(out_dir)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("error: fastvideo-kernel is not built (no fastvideo_kernel package under ")
    assert lines[0].endswith(f"tail of the build log {log}:")
    assert lines[1:] == [f"line {i}" for i in range(71, 100)] + ["nvcc fatal   : boom"]
    assert not out_dir.exists()  # stopped before writing anything
    # no log given / a log that is not there: still one line, then why there is no tail
    assert vsa_anchor.main(["--site", str(tmp_path / "site")]) == 3
    assert capsys.readouterr().out.splitlines()[1] == "(no --build-log given)"
    assert vsa_anchor.main(["--site", str(tmp_path / "site"), "--build-log", str(tmp_path / "none.log")]) == 3
    assert "No such file" in capsys.readouterr().out.splitlines()[1]
    # the compiler's message further up than the tail (pip's trailer follows it) comes first
    log.write_text("ok\nFAILED: CMakeFiles/x.cu.o\nx.cu(3): error: identifier \"y\" is undefined\n"
                   + "".join(f"trailer {i}\n" for i in range(40)))
    assert vsa_anchor.main(["--site", str(tmp_path / "site"), "--build-log", str(log)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:5] == ["first error lines:", "FAILED: CMakeFiles/x.cu.o", 'x.cu(3): error: identifier "y" is undefined',
                          "last lines:"]
    assert lines[5:] == [f"trailer {i}" for i in range(10, 40)]


def test_built_without_the_thunderkittens_op(tmp_path, capsys, clean_imports):
    pkg = tmp_path / "site" / "fastvideo_kernel"
    (pkg / "_C").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0.test'\n")
    (pkg / "_C" / "fastvideo_kernel_ops.py").write_text("def sta_fwd():\n    pass\n")  # TK off: no block_sparse_fwd
    assert vsa_anchor.main(["--site", str(tmp_path / "site")]) == 3
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("error: fastvideo-kernel is not built (") and "has no block_sparse_fwd" in line
    (pkg / "_C" / "fastvideo_kernel_ops.py").write_text("import no_such_module_here\n")
    for name in [m for m in sys.modules if m.split(".")[0] == "fastvideo_kernel"]:
        del sys.modules[name]
    assert vsa_anchor.main(["--site", str(tmp_path / "site")]) == 3
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in capsys.readouterr().out.splitlines()[0]


def test_variable_block_sizes_mark_the_padded_keys():
    vbs = vsa_anchor.variable_block_sizes(32760, 32768, "cpu")
    assert vbs.dtype == torch.int32 and vbs.numel() == 512 and int(vbs[-1]) == 56 and bool((vbs[:-1] == 64).all())
    vbs = vsa_anchor.variable_block_sizes(75600, 75648, "cpu")  # padded to 128: the last 64-token block has 16
    assert vbs.numel() == 1182 and int(vbs[-1]) == 16 and int(vbs.sum()) == 75600
    assert vsa_anchor.variable_block_sizes(130, 256, "cpu").tolist() == [64, 64, 2, 0]


def _upstream_standin(q, k, v, idx, cnt, vbs):
    """Upstream's block_sparse_fwd in PyTorch: [1, H, S, D] in; (o, -sqrt(D) x LSE [1, H, S, 1]) out."""
    _, H, S, D = q.shape
    nb = S // 64
    bm = torch.zeros(1, H, nb, nb, dtype=torch.bool)
    for h in range(H):
        for m in range(nb):
            bm[0, h, m, idx[0, h, m, :cnt[0, h, m]].long()] = True
    tok = torch.arange(S)
    mask = bm.repeat_interleave(64, 2).repeat_interleave(64, 3) & ((tok % 64) < vbs[tok // 64].long())
    kk, vv = (t.repeat_interleave(H // t.shape[1], 1).float() for t in (k, v))
    s = (q.float() @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vv).to(q.dtype), (-math.sqrt(D) * lse)[..., None]


def test_adapter_against_a_standin_with_upstreams_convention(tmp_path, monkeypatch):
    """The layout transposes, the padding mask and the LSE conversion of check() / upstream_fns(): a stand-in
    that computes what upstream's op computes, in its layout, matches the float32 reference."""
    monkeypatch.setattr(vsa_anchor.common, "DEVICE", "cpu")
    ops = types.SimpleNamespace(block_sparse_fwd=_upstream_standin)
    rec = vsa_anchor.Recorder(str(tmp_path), "vsa_anchor", {})
    rows = vsa_anchor.check(rec, ops, ["tk"], {}, cases=((2, 1, 32, 460), (3, 3, 64, 330)), ours=False)
    assert [r["impl"] for r in rows] == ["upstream TK"] * 2 and not rec.data["notes"]
    for r in rows:
        assert r["finite"] and r["rel_err"] < 1e-2 and r["lse_max_err"] < 1e-4, r
    # the timed candidates return [B, S, H, D]; with and without the layout copies the same output
    from common import make_qkv
    from sparse import random_lists

    q, k, v = make_qkv(1, 256, 2, 32, seed=1, device="cpu")
    idx, cnt = random_lists(1, 2, 4, 4, 2, seed=1, device="cpu")
    fns = vsa_anchor.upstream_fns(ops, ["tk", "tk_layout"], q, k, v, idx, cnt, 200)
    a, b = fns["upstream TK"](), fns["upstream TK + layout"]()
    assert a.shape == b.shape == q.shape and torch.equal(a, b)
    # a wrong padding mask would show: keys 200..255 attended changes the output
    full = vsa_anchor.upstream_fns(ops, ["tk"], q, k, v, idx, cnt, 256)["upstream TK"]()
    assert not torch.allclose(a.float(), full.float())
