"""The README's collective job, interleaved: two gradwire builds and Gloo (root; issue #23).

    python -m gradwire.experiments.job_compare --old-bin OLD/gradwire --old-commit REV \\
        --new-bin NEW/gradwire --new-commit REV --out DIR [--job collective/jobs/racks8.toml]
        [--iterations 20] [--repeats 3] [--new-algorithms rack,auto,ring]
    python -m gradwire.experiments.job_compare --from DIR/job.json --out DIR [--max-other-cpu 0.1]

Per repeat, one run of each variant: ``OLD job run JOB --algorithm rack --iterations N
--json`` (``old-rack``), the same with NEW and every algorithm of ``--new-algorithms``
(``new-rack``, ...), and ``python -m gradwire.experiments.job_gloo`` (``gloo``, the same job
on torch.distributed's Gloo). The order alternates: even repeats run old first and Gloo last,
odd repeats the reverse, so a drift of the machine's load hits both ends alike.

Each run takes /run/gradwire-fabric.lock for itself only (another engineer's benchmark then
waits at most one run), then waits up to ``--quiet-wait`` seconds for a quiet machine (at most
``--max-other-cpu`` of it busy over a second), and records what other programs took while it
ran (the machine's user time minus this run's own processes'; system time is not comparable,
softirqs being charged to whoever they interrupt): ``other_cpu_share``; a run
where that is above ``--max-other-cpu`` (default 10 %, as the all-reduce benchmark's) is
``disturbed``: kept in the JSON and CSV, left out of the summary's figures.

Per run: each iteration's time is its slowest rank's; the first ``--warmup`` iterations
(default 1) are dropped; mean and median over the rest. Every result of every run is checked
by the run itself (exact sums); a run that fails or is not verified is recorded with its error
and left out of the summary. Per variant the summary gives the mean of the runs' means and
their range (min..max), the median of the runs' medians, and the ratios old-rack / new-X and
gloo / new-X of those means (how many times faster than the old build and than Gloo).

Writes DIR/job.json (metadata, builds, every run with its per-iteration times, the summary),
DIR/job.csv (one row per run) and DIR/summary.md (the table).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import fcntl
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradwire.experiments.job_gloo import summarize

FABRIC_LOCK = Path("/run/gradwire-fabric.lock")
HZ = os.sysconf("SC_CLK_TCK")


def busy_jiffies() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    return v[0] + v[1] + v[2] + v[5] + v[6]


def user_jiffies() -> int:
    """The machine's user + nice time: what other programs' share is judged from (system
    time does not add up between /proc/stat and the processes: softirqs are charged to
    whoever they interrupt)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1]


def children_cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime, r.ru_stime


class Lock:
    """flock on the fabric lock file, for one run."""

    def __enter__(self) -> "Lock":
        self.fd = os.open(FABRIC_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.waited = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def quiet(max_share: float, wait_s: float) -> tuple[float, float]:
    """Waits at most ``wait_s`` until the machine is at most ``max_share`` busy over 1 s;
    returns (seconds waited, the last share)."""
    t0 = time.monotonic()
    cores = os.cpu_count() or 1
    while True:
        a, ta = busy_jiffies(), time.monotonic()
        time.sleep(1.0)
        share = (busy_jiffies() - a) / HZ / ((time.monotonic() - ta) * cores)
        if share <= max_share or time.monotonic() - t0 >= wait_s:
            return time.monotonic() - t0, share


def timed(cmd: list[str], cwd: Path, timeout: float) -> dict:
    """Runs ``cmd``; its output, exit code, wall time and the share of the machine other
    programs took meanwhile."""
    cores = os.cpu_count() or 1
    j0, c0, t0 = user_jiffies(), children_cpu(), time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, e.stdout or "", f"timed out after {timeout} s"
    wall = time.monotonic() - t0
    c1 = children_cpu()
    own_user, own = c1[0] - c0[0], (c1[0] - c0[0]) + (c1[1] - c0[1])
    other = max(0.0, (user_jiffies() - j0) / HZ - own_user)
    return {"rc": rc, "stdout": out if isinstance(out, str) else out.decode(errors="replace"),
            "stderr": err if isinstance(err, str) else err.decode(errors="replace"), "wall_s": wall,
            "own_cpu_s": own, "other_cpu_share": other / (wall * cores)}  # fmt: skip


def run_variant(v: dict, a: argparse.Namespace, repo: Path) -> dict:
    """One run of variant ``v``: the row (error set when it failed)."""
    row: dict[str, Any] = {"variant": v["name"], "implementation": v["impl"], "commit": v["commit"],
                           "algorithm": v["algorithm"], "error": None}  # fmt: skip
    with Lock() as lock, tempfile.TemporaryDirectory(prefix="gw-job-compare-") as tmp:
        row["lock_wait_s"] = lock.waited
        row["quiet_wait_s"], row["share_before"] = quiet(a.max_other_cpu, a.quiet_wait)
        row["loadavg_before"] = float(open("/proc/loadavg").read().split()[0])
        row["started"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if v["impl"] == "gradwire":
            cmd = [v["bin"], "job", "run", a.job, "--algorithm", v["algorithm"], "--iterations",
                   str(a.iterations), "--json"]  # fmt: skip
        else:
            cmd = [sys.executable, "-m", "gradwire.experiments.job_gloo", "--job", a.job, "--iterations",
                   str(a.iterations), "--out", tmp]  # fmt: skip
        r = timed(cmd, repo, a.run_timeout)
        row["command"] = " ".join(cmd if v["impl"] == "gradwire" else cmd[:-1] + ["DIR"])
        row.update(wall_s=r["wall_s"], own_cpu_s=r["own_cpu_s"], other_cpu_share=r["other_cpu_share"])
        if r["rc"] != 0:
            row["error"] = f"exit {r['rc']}: {r['stderr'][-1500:]}"
            return row
        try:
            if v["impl"] == "gradwire":
                reports = json.loads(r["stdout"])
            else:
                reports = json.loads((Path(tmp) / "job_gloo.json").read_text())["reports"]
        except (ValueError, OSError) as e:
            row["error"] = f"no report: {e}"
            return row
    s = summarize(reports, a.warmup)
    row.update({k: s[k] for k in ("iterations", "warmup_dropped", "mean_ms", "median_ms", "min_ms", "max_ms",
                                  "rank_mean_ms", "verified", "per_iteration_ms")})  # fmt: skip
    row["world"] = len(reports)
    row["ranks"] = [{"rank": x["rank"], "verified": x["verified"], "ms": [i["ms"] for i in x["iterations"]]}
                    for x in reports]  # fmt: skip
    if not s["verified"]:
        row["error"] = "not every rank verified its results"
    return row


def variant_summary(rows: list[dict], max_other_cpu: float) -> list[dict]:
    """Per variant, over its runs that completed, were verified and were not disturbed
    (other programs took at most ``max_other_cpu`` of the machine): the mean of the runs'
    means, their range, the median of their medians; the mean over every completed run
    (disturbed ones too) beside it."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        done = [r for r in rows if r["variant"] == name and r["error"] is None]
        ok = [r for r in done if r["other_cpu_share"] <= max_other_cpu]
        failed = [r for r in rows if r["variant"] == name and r["error"] is not None]
        first = next(r for r in rows if r["variant"] == name)
        e: dict[str, Any] = {"variant": name, "implementation": first["implementation"], "commit": first["commit"],
                             "algorithm": first["algorithm"], "runs": len(ok), "failed_runs": len(failed),
                             "disturbed_runs": len(done) - len(ok)}  # fmt: skip
        if ok:
            means = [r["mean_ms"] for r in ok]
            e.update(mean_ms=statistics.fmean(means), mean_min_ms=min(means), mean_max_ms=max(means),
                     median_ms=statistics.median(r["median_ms"] for r in ok),
                     other_cpu_share_max=max(r["other_cpu_share"] for r in ok))  # fmt: skip
        if done:
            e["mean_ms_all_runs"] = statistics.fmean(r["mean_ms"] for r in done)
        out.append(e)
    by = {e["variant"]: e for e in out}
    old, gloo = by.get("old-rack", {}).get("mean_ms"), by.get("gloo", {}).get("mean_ms")
    for e in out:
        m = e.get("mean_ms")
        e["old_over_this"] = old / m if old and m else None
        e["this_over_gloo"] = m / gloo if gloo and m else None
        e["gloo_over_this"] = gloo / m if gloo and m else None
    return out


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def summary_md(summary: list[dict], a: argparse.Namespace) -> str:
    lines = [
        f"Per iteration: the slowest rank's time (ms), first {a.warmup} of {a.iterations} iterations dropped as "
        "warm-up; per variant the mean over repeats of each run's mean (range over repeats) and the median of the "
        "runs' medians.",
        "",
        "| variant | build | runs | mean ms (range) | median ms | mean ms, all runs | old-rack / this | Gloo / this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        build = "Gloo (torch " + a.torch + ")" if e["implementation"] == "gloo" else e["commit"][:7]
        rng = f"{fmt(e.get('mean_ms'))} ({fmt(e.get('mean_min_ms'))}-{fmt(e.get('mean_max_ms'))})"
        runs = f"{e['runs']}" + (f" (+{e['disturbed_runs']} disturbed)" if e["disturbed_runs"] else "") \
            + (f" (+{e['failed_runs']} failed)" if e["failed_runs"] else "")  # fmt: skip
        lines.append(f"| {e['variant']} | {build} | {runs} | {rng} | {fmt(e.get('median_ms'))} | "
                     f"{fmt(e.get('mean_ms_all_runs'))} | {fmt(e['old_over_this'], '.2f')}x | "
                     f"{fmt(e['gloo_over_this'], '.2f')}x |")  # fmt: skip
    lines += ["", f"Disturbed: other programs took more than {100 * a.max_other_cpu:.0f} % of the machine during the "
              "run; such runs are in the JSON and CSV and in 'mean ms, all runs', not in the other columns."]
    return "\n".join(lines) + "\n"


CSV_KEYS = ["repeat", "order", "variant", "implementation", "commit", "algorithm", "iterations", "warmup_dropped",
            "mean_ms", "median_ms", "min_ms", "max_ms", "rank_mean_ms", "verified", "wall_s", "own_cpu_s",
            "other_cpu_share", "share_before", "loadavg_before", "lock_wait_s", "quiet_wait_s", "started",
            "disturbed", "error"]  # fmt: skip


def sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradwire.experiments.job_compare",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--old-bin", help="the old build's gradwire")
    p.add_argument("--old-commit", help="the commit it was built from (recorded)")
    p.add_argument("--new-bin", help="the new build's gradwire")
    p.add_argument("--new-commit", help="the commit it was built from (recorded)")
    p.add_argument("--job", default="collective/jobs/racks8.toml")
    p.add_argument("--old-algorithm", default="rack")
    p.add_argument("--new-algorithms", default="rack,auto,ring")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--max-other-cpu", type=float, default=0.10,
                   help="a run during which other programs took more of the machine is 'disturbed'")
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--from", dest="from_json", metavar="JOB_JSON",
                   help="run nothing: summarize the runs of an earlier job.json again (e.g. with another "
                        "--max-other-cpu) and write DIR's files")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if not a.from_json and not all((a.old_bin, a.old_commit, a.new_bin, a.new_commit)):
        p.error("--old-bin, --old-commit, --new-bin and --new-commit are required (unless --from)")
    return a


def write_outputs(out: Path, doc: dict, a: argparse.Namespace) -> str:
    """Marks disturbed runs, summarizes, writes job.json, job.csv and summary.md; the table."""
    rows = doc["runs"]
    for r in rows:
        r["disturbed"] = r["other_cpu_share"] > a.max_other_cpu
    doc["config"]["max_other_cpu"] = a.max_other_cpu
    doc["summary"] = variant_summary(rows, a.max_other_cpu)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(doc, indent=1) + "\n")
    with open(out / "job.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in CSV_KEYS})
    md = summary_md(doc["summary"], a)
    (out / "summary.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    out = Path(a.out)
    if a.from_json:
        doc = json.loads(Path(a.from_json).read_text())
        a.torch = doc["metadata"]["torch"]
        doc["metadata"]["resummarized"] = "python -m gradwire.experiments.job_compare " + " ".join(argv)
        print(write_outputs(out, doc, a))
        return 0 if all(r["error"] is None for r in doc["runs"]) else 1
    a.torch = torch.__version__
    if os.geteuid() != 0:
        sys.exit("job_compare: needs root (network namespaces)")
    repo = Path.cwd()
    variants = [{"name": f"old-{a.old_algorithm}", "impl": "gradwire", "bin": a.old_bin, "commit": a.old_commit,
                 "algorithm": a.old_algorithm}]  # fmt: skip
    variants += [{"name": f"new-{alg}", "impl": "gradwire", "bin": a.new_bin, "commit": a.new_commit, "algorithm": alg}
                 for alg in a.new_algorithms.split(",") if alg]  # fmt: skip
    if not a.no_gloo:
        variants.append({"name": "gloo", "impl": "gloo", "bin": None, "commit": None, "algorithm": "gloo"})
    rows = []
    for rep in range(a.repeats):
        order = variants if rep % 2 == 0 else variants[::-1]
        for i, v in enumerate(order):
            row = run_variant(v, a, repo)
            row.update(repeat=rep, order=i)
            rows.append(row)
            print(f"repeat {rep} {v['name']}: "
                  + (f"mean {row['mean_ms']:.1f} ms, median {row['median_ms']:.1f} ms, other CPU "
                     f"{100 * row['other_cpu_share']:.0f} %" if row["error"] is None else f"FAILED: {row['error']}"),
                  flush=True)  # fmt: skip
    doc = {
        "metadata": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m gradwire.experiments.job_compare " + " ".join(argv),
            "kernel": platform.release(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": a.torch,
            "timing": f"per iteration the slowest rank's wall time (fill, every layer's all-reduce, exact check); "
                      f"first {a.warmup} iteration(s) dropped as warm-up",
        },
        "config": {"job": a.job, "iterations": a.iterations, "repeats": a.repeats, "warmup": a.warmup,
                   "quiet_wait_s": a.quiet_wait},
        "builds": {"old": {"commit": a.old_commit, "bin_sha256": sha256(a.old_bin)},
                   "new": {"commit": a.new_commit, "bin_sha256": sha256(a.new_bin)}},
        "runs": rows,
    }  # fmt: skip
    print(write_outputs(out, doc, a))
    return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
