"""``bench/server_faults.py --quick`` against a real ``ditattn serve`` process (tiny model, CPU): bad
input and mixed request storms, disconnects, DELETE of a running job, SIGTERM with queued video
jobs and a restart with the same --output-dir, a second SIGTERM, and no file removed without a log
line (issue 23).  The script asserts each stage; this test requires its verdict and key figures."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_server_fault_script_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "server_faults.py"), "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=1200)
    report = json.loads((tmp_path / "server_faults.json").read_text())
    assert proc.returncode == 0 and report["ok"], proc.stdout + proc.stderr
    assert report["bad_input"]["n_5xx"] == 0 and report["bad_input"]["requests"] >= 60
    assert report["disconnects"]["queued_computed"] == 0
    assert report["sigterm"]["exit_status"] == 0 and report["sigterm"]["jobs_kept"] == 5
    assert report["second_sigterm"]["exit_status"] in (143, -15)
    assert report["files"]["removed_without_log_line"] == 0
    assert "Traceback" not in "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
