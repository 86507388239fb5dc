"""Summarise an Nsight Compute report's raw page: per profiled kernel launch, the duration, the issue-slot
and per-pipe utilisation (tensor / MUFU "xu" / FMA / ALU ...), and the largest warp-stall reasons — the
numbers that say which unit limits a kernel.

    ncu --import $OUT/sage.ncu-rep --page raw --csv > $OUT/sage_raw.csv
    python3 bench/ncu_summary.py $OUT/sage_raw.csv [--top 8]

Metric names differ between Nsight Compute versions, so metrics are picked by name fragments (every
``*pipe*`` utilisation in percent of peak, ``issue_active``, ``warp_latency_issue_stalled`` /
``pcsamp_warps_issue_stalled``) rather than by a fixed list; every metric stays in the CSV.
"""
from __future__ import annotations

import argparse
import csv
import sys


def _num(x: str):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None


def summarise(rows: list[dict], top: int = 8) -> list[str]:
    """Lines of text, one block per kernel launch of ``rows`` (the raw page's records, metric -> value)."""
    out = []
    for r in rows:
        name = r.get("Kernel Name") or r.get("Function Name") or "?"
        dur = _num(r.get("gpu__time_duration.sum", "") or "")
        out.append(f"== {name[:90]}  id {r.get('ID', '?')}  duration {dur if dur is not None else '?'} (ns/us as in CSV)")
        pipes = {k: _num(v) for k, v in r.items() if "pipe" in k and "pct_of_peak" in k and _num(v) is not None}
        for k, v in sorted(pipes.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"   pipe  {v:7.2f} %  {k}")
        for k, v in r.items():
            if "issue_active" in k and "pct" in k and _num(v) is not None:
                out.append(f"   issue {_num(v):7.2f} %  {k}")
        stalls = {k: _num(v) for k, v in r.items()
                  if ("issue_stalled" in k) and _num(v) is not None and ("ratio" in k or k.endswith(".sum") or "pct" in k)}
        for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"   stall {v:9.3f}    {k}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="`ncu --import REP --page raw --csv` output")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        data = list(csv.reader(f))
    if len(data) < 3:
        print(f"{args.csv}: no profiled launches (header, units, then one row per launch expected)", file=sys.stderr)
        return 2
    head = data[0]
    rows = [dict(zip(head, row)) for row in data[2:]]
    print("\n".join(summarise(rows, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
