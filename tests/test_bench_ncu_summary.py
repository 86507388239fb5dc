"""bench/ncu_summary.py on a hand-written raw-page CSV (the layout `ncu --page raw --csv` writes: a header of
metric names, a row of units, one row per launch)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))


def test_summary_orders_pipes_and_stalls(tmp_path, capsys):
    import ncu_summary

    path = tmp_path / "raw.csv"
    path.write_text(
        '"ID","Kernel Name","gpu__time_duration.sum","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",'
        '"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","smsp__issue_active.avg.pct_of_peak_sustained_active",'
        '"smsp__average_warp_latency_issue_stalled_wait.ratio","smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio"\n'
        '"","","usecond","%","%","%","ratio","ratio"\n'
        '"3","_sage_fwd_sm90","30,100","48.0","61.2","71.5","0.4","1.7"\n')
    assert ncu_summary.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("== _sage_fwd_sm90  id 3  duration 30100.0")
    pipes = [ln for ln in lines if ln.lstrip().startswith("pipe")]
    assert "tensor_op_gmma" in pipes[0] and "61.20" in pipes[0] and "pipe_xu" in pipes[1]
    assert any("issue" in ln and "71.50" in ln for ln in lines)
    stalls = [ln for ln in lines if ln.lstrip().startswith("stall")]
    assert "math_pipe_throttle" in stalls[0] and "wait" in stalls[1]


def test_summary_refuses_a_report_without_launches(tmp_path, capsys):
    import ncu_summary

    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name"\n"",""\n')
    assert ncu_summary.main([str(path)]) == 2
    assert "no profiled launches" in capsys.readouterr().err
