#!/usr/bin/env python3
"""The README's demo, old binary against new, interleaved (issue #23, docs/results.md).

Runs `gradwire demo --datapath D --size 64MiB --count 8 --inject-loss 0.02 --loss-bound 0.01
--json` with each binary, for each datapath, `--repeats` times; the order of old and new
alternates between repeats. For every run it keeps the demo's JSON report (goodput over the
transfers' wall time, per-transfer times, resends) and the machine's CPU time over the whole
process (system-wide, from /proc/stat: every core's non-idle time, so it also counts
anything else running on the machine; the load average before each run is recorded).
Writes demo.json (every run) and demo.csv (one row per run) into --out.
"""

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import time

DEMO = ["--size", "64MiB", "--count", "8", "--inject-loss", "0.02", "--loss-bound", "0.01", "--json"]


def cpu_jiffies():
    """(non-idle, total) jiffies of all cores."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    total = sum(v[:8])  # without guest, counted in user already
    return total - idle, total


def run(binary, datapath):
    load = os.getloadavg()[0]
    busy0, _ = cpu_jiffies()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([binary, "demo", "--datapath", datapath, *DEMO], capture_output=True, text=True)
    wall = time.monotonic() - t0
    busy1, _ = cpu_jiffies()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{binary} demo --datapath {datapath} failed: {p.stderr}")
    report = json.loads(p.stdout)
    hz = os.sysconf("SC_CLK_TCK")
    return {
        "wall_s": wall,
        "cpu_s": (busy1 - busy0) / hz,
        # The demo process's own user + system time (softirq work of the kernel's network
        # stack done on its behalf may be charged elsewhere: the system-wide figure has it).
        "process_cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "load1_before": load,
        "report": report,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--old-rev", required=True)
    ap.add_argument("--new-rev", required=True)
    ap.add_argument("--datapaths", default="udp,afxdp")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    runs = []
    for rep in range(a.repeats):
        for dp in a.datapaths.split(","):
            order = [("old", a.old, a.old_rev), ("new", a.new, a.new_rev)]
            if rep % 2:
                order.reverse()
            for name, binary, rev in order:
                r = run(binary, dp)
                r.update({"version": name, "rev": rev, "datapath": dp, "repeat": rep + 1})
                rep_ = r["report"]
                print(
                    f"{dp:6} {name:3} rep {rep + 1}: goodput {rep_['goodput_gbps']:.2f} Gbit/s over "
                    f"{rep_['elapsed_s']:.2f} s, process {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s "
                    f"(process {r['process_cpu_s']:.2f} s) "
                    f"(load {r['load1_before']:.1f}), delivered min {rep_['delivered_fraction']:.4f}, "
                    f"verified {rep_['verified']}",
                    flush=True,
                )
                runs.append(r)
    with open(os.path.join(a.out, "demo.json"), "w") as f:
        json.dump({"command": ["gradwire", "demo", "--datapath", "D", *DEMO], "runs": runs}, f, indent=1)
    with open(os.path.join(a.out, "demo.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["datapath", "version", "rev", "repeat", "protocol", "goodput_gbps", "elapsed_s",
                    "fct_p50_ms", "fct_p99_ms", "delivered_min", "retransmitted", "verified",
                    "process_wall_s", "cpu_s_system_wide", "cpu_s_process", "load1_before"])
        for r in runs:
            rep = r["report"]
            retx = sum(x.get("retransmitted") or 0 for x in rep["transfers"])
            w.writerow([r["datapath"], r["version"], r["rev"], r["repeat"], rep.get("protocol", "flow"),
                        f"{rep['goodput_gbps']:.3f}", f"{rep['elapsed_s']:.3f}",
                        f"{rep['fct_p50_us'] / 1e3:.2f}", f"{rep['fct_p99_us'] / 1e3:.2f}",
                        f"{rep['delivered_fraction']:.4f}", retx, rep["verified"],
                        f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['process_cpu_s']:.2f}",
                        f"{r['load1_before']:.2f}"])
    print("median over repeats:")
    for dp in a.datapaths.split(","):
        for name in ("old", "new"):
            rs = [r for r in runs if r["datapath"] == dp and r["version"] == name]
            g = statistics.median(r["report"]["goodput_gbps"] for r in rs)
            c = statistics.median(r["cpu_s"] for r in rs)
            pc = statistics.median(r["process_cpu_s"] for r in rs)
            wall = statistics.median(r["wall_s"] for r in rs)
            print(f"  {dp:6} {name}: goodput {g:.2f} Gbit/s, process {wall:.2f} s, "
                  f"CPU system-wide {c:.2f} s, process {pc:.2f} s")


if __name__ == "__main__":
    main()
