"""bench/ray_process.py on the CPU (tiny model, 16x16, two rounds): the driver, a Ray actor and the pipeline
process of a Ray actor each generate, in three different processes, and the table is printed last."""

import json
import os
import sys

import pytest

pytest.importorskip("ray")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def _run(folder):
    argv = ["--device", "cpu", "--model-path", "ditattn:tiny-wan", "--size", "16", "--rounds", "2"]
    return dict(args=[sys.executable, os.path.join(BENCH, "ray_process.py"), *argv, "--out", folder], timeout=300)


@pytest.mark.background.with_args(_run)  # Ray and three model loads: run meanwhile
def test_ray_process_times_the_three_places(background_run):
    proc, tmp_path = background_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "ray_process.json").read_text())
    names = ["driver", "ray actor", "pipeline process of a ray actor"]
    assert list(data["times_ms"]) == names and all(len(t) == 2 and min(t) > 0 for t in data["times_ms"].values())
    assert len(set(data["pids"].values())) == 3  # three processes: the hosted pipeline is not the actor's
    assert data["summary"]["driver"]["paired"] == 0.0
    assert proc.stdout.strip().splitlines()[-1].startswith("pipeline process of a ray actor")
