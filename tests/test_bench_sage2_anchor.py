"""bench/sage2_anchor.py on CPU: its arguments, and the one-line stop when the upstream build is missing."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
sage2_anchor = pytest.importorskip("sage2_anchor")


def test_defaults_time_the_issue_shape_first():
    a = sage2_anchor.parse_args([])
    assert a.shape_list[0] == (1, 40, 32760, 128)
    assert {(1, 40, 4096, 128), (1, 40, 16384, 128), (1, 40, 75600, 128), (1, 12, 32760, 128)} <= set(a.shape_list)
    assert a.cand_list == list(sage2_anchor.CANDIDATES)
    assert "sage2_kernel" in a.cand_list and "fa4" in a.cand_list


def test_arguments_parse():
    a = sage2_anchor.parse_args(["--shapes", "2,4,1000,64; 1,1,77,128", "--candidates", "sage2, fa4",
                                 "--budget-s", "12", "--sage2-dir", "/x"])
    assert a.shape_list == [(2, 4, 1000, 64), (1, 1, 77, 128)]
    assert a.cand_list == ["sage2", "fa4"] and a.budget_s == 12 and a.sage2_dir == "/x"


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "1,40,32760"], "--shapes takes 'B,H,S,D;...'"),
    (["--shapes", "1,40,0,128"], "--shapes takes"),
    (["--shapes", "a,b,c,d"], "--shapes takes"),
    (["--candidates", "sage2,flash3"], "unknown: flash3"),
    (["--candidates", ","], "unknown: (empty)"),
    (["--budget-s", "0"], "--budget-s must be positive"),
])
def test_bad_arguments_end_in_one_usage_error(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        sage2_anchor.parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_build_problem_names_what_is_missing(tmp_path):
    assert "no upstream package" in sage2_anchor.build_problem(str(tmp_path))
    pkg = tmp_path / "sageattention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    assert "_qattn_sm90, _fused" in sage2_anchor.build_problem(str(tmp_path))
    (pkg / "_fused.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    why = sage2_anchor.build_problem(str(tmp_path))
    assert "_qattn_sm90" in why and "_fused" not in why
    (pkg / "_qattn_sm90.so").write_bytes(b"")
    assert sage2_anchor.build_problem(str(tmp_path)) is None


def test_not_built_stops_with_one_line_and_the_log_tail(tmp_path, capsys):
    log = tmp_path / "sage2_build.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "nvcc fatal : Unsupported gpu architecture\n")
    with pytest.raises(SystemExit) as exc:
        sage2_anchor.main(["--sage2-dir", str(tmp_path / "none"), "--build-log", str(log)])
    assert exc.value.code == 3
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: upstream SageAttention2 is not built: no upstream package at ")
    assert err[-1] == "nvcc fatal : Unsupported gpu architecture"
    assert "line 99" in err and "line 50" not in err  # the tail only (40 lines)


def test_not_built_without_a_log(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sage2_anchor.main(["--sage2-dir", str(tmp_path), "--build-log", str(tmp_path / "missing.log")])
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert err.startswith("error: upstream SageAttention2 is not built")
    assert f"(no build log at {tmp_path / 'missing.log'})" in err


def test_a_package_without_its_sm90_extension_is_refused(tmp_path, monkeypatch):
    pkg = tmp_path / "sageattention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("SM90_ENABLED = False\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "sageattention" or m.startswith("sageattention.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with pytest.raises(sage2_anchor.NotBuilt, match="the SM90 extension does not load: ModuleNotFoundError"):
            sage2_anchor.load_upstream(str(tmp_path))
        assert sys.path[0] == str(tmp_path)
    finally:
        for name in [m for m in sys.modules if m == "sageattention" or m.startswith("sageattention.")]:
            del sys.modules[name]
