"""``bench/server_faults.py --quick`` against a real ``ditattn serve`` process (tiny model, CPU): bad
input and mixed request storms, disconnects, DELETE of a running job, SIGTERM with queued video
jobs and a restart with the same --output-dir, a second SIGTERM, and no file removed without a log
line.  The script asserts each stage; this test requires its verdict and key figures."""

import json


def test_server_fault_script_quick(tmp_path, run_bench):
    stdout = run_bench("server_faults.py", "--quick", "--out", str(tmp_path))  # the servers are subprocesses
    report = json.loads((tmp_path / "server_faults.json").read_text())
    assert report["ok"], stdout
    assert report["bad_input"]["n_5xx"] == 0 and report["bad_input"]["requests"] >= 60
    assert report["disconnects"]["queued_computed"] == 0
    assert report["sigterm"]["exit_status"] == 0 and report["sigterm"]["jobs_kept"] == 5
    assert report["second_sigterm"]["exit_status"] in (143, -15)
    assert report["files"]["removed_without_log_line"] == 0
    assert "Traceback" not in "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
