"""Where a pipeline runs fastest under Ray: the same generate in the driver, in a plain Ray actor, and in the
pipeline process a replica starts (``ditattn.server.pipehost``, ``--replica-process``) from such an actor.

    PYTHONPATH=src python bench/ray_process.py --out OUTDIR [--rounds 50] [--size 256] [--device cuda]
        [--model-path ditattn:shapes]

One image (``--size`` square, one frame, the model's own steps and guidance) per call; after four warm-up
calls each, ``--rounds`` rounds call the three in turn (the order reversed every other round, so drift hits
all alike).  Printed: the median and mean of each, and each one's paired mean difference from the driver with
its standard error.  Every process runs one torch thread (``OMP_NUM_THREADS=1``, as Ray gives an actor that
declares one CPU).  Writes ``ray_process.json`` (every time) under OUTDIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Generator:
    """One pipeline (``ditattn.server.runner.build_runner``) and one image job per call."""

    def __init__(self, model_path: str, device: str, size: int, hosted: bool = False):
        from ditattn.runconfig import RunConfig

        cfg = RunConfig.from_mapping({"model-path": model_path, "device": device})
        if hosted:
            from ditattn.server.pipehost import HostedRunner

            self.runner = HostedRunner(cfg, threads=1)
        else:
            from ditattn.server.runner import build_runner

            self.runner = build_runner(cfg)
        self.size, self.pid = size, getattr(self.runner, "pid", os.getpid())
        for i in range(4):
            self.run(i)

    def run(self, seed: int) -> float:
        from ditattn.server.jobs import GenerationJob

        d = self.runner.defaults
        job = GenerationJob(
            kind="image",
            model="m",
            prompt="a red circle moving right",
            width=self.size,
            height=self.size,
            num_frames=1,
            num_inference_steps=d.num_inference_steps,
            guidance_scale=d.guidance_scale,
            seed=seed,
            state=self.runner.prepare(None, None),
        )
        t0 = time.perf_counter()
        self.runner.run_batch([job])  # frames copied back to the host: the device has finished
        return (time.perf_counter() - t0) * 1e3

    def where(self) -> int:
        return self.pid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-path", default="ditattn:shapes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    paths = (os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _system_config={"worker_niceness": 0})
    gpu = 0.4 if a.device.startswith("cuda") else 0
    Actor = ray.remote(num_cpus=1, num_gpus=gpu)(Generator)
    args = (a.model_path, a.device, a.size)
    subjects = {
        "driver": Generator(*args),
        "ray actor": Actor.remote(*args),
        "pipeline process of a ray actor": Actor.remote(*args, hosted=True),
    }

    def call(name, seed):
        s = subjects[name]
        return s.run(seed) if name == "driver" else ray.get(s.run.remote(seed))

    pids = {n: (s.where() if n == "driver" else ray.get(s.where.remote())) for n, s in subjects.items()}
    times = {n: [] for n in subjects}
    order = list(subjects)
    for r in range(a.rounds):
        for n in order if r % 2 == 0 else order[::-1]:
            times[n].append(call(n, 1000 + r))
    ray.shutdown()
    base = times["driver"]
    rows = {}
    print(f"{a.model_path} {a.size}x{a.size}, 1 frame, on {a.device}: {a.rounds} alternating rounds (ms)")
    print(f"{'where the pipeline runs':34s} {'median':>8s} {'mean':>8s}   paired vs the driver")
    for n, t in times.items():
        d = [x - y for x, y in zip(t, base)]
        se = statistics.stdev(d) / len(d) ** 0.5 if n != "driver" and len(d) > 1 else 0.0
        rows[n] = {"median": statistics.median(t), "mean": statistics.mean(t), "paired": statistics.mean(d), "se": se}
        print(
            f"{n:34s} {rows[n]['median']:8.1f} {rows[n]['mean']:8.1f}   "
            + ("-" if n == "driver" else f"{rows[n]['paired']:+.1f} +- {se:.1f}")
        )
    with open(os.path.join(a.out, "ray_process.json"), "w") as f:
        json.dump({"args": vars(a), "pids": pids, "times_ms": times, "summary": rows}, f, indent=1)


if __name__ == "__main__":
    main()
