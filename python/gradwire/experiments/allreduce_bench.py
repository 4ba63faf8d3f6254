"""All-reduce benchmark, nccl-tests / OSU shaped: gradwire's all-reduce against Gloo's.

    python -m gradwire.experiments.allreduce_bench --out DIR [--quick]
        [--ranks 2,4,8] [--sizes 4:64M | 4,1K,64K] [--iters 50] [--warmup 5] [--repeats 2]
        [--impl gradwire,gloo] [--loss-bounds 0,0.01] [--algorithms ring,...]
        [--net loopback,fabric] [--link-loss 0,0.01,0.02] [--rate 100Mbit]

One process per rank, both implementations in the same processes of the same run, on the same
network: ``loopback`` (ranks on 127.0.0.1 in this namespace) or ``fabric`` (one network
namespace per rank on gradwire's emulated switch, root; a fresh testbed per link loss and rank
count, built as the convergence experiment builds its own, at ``--rate``, which the fabric
keeps up with; a case during which more than 1 % of the fabric's departures were late is
marked ``valid: false`` and is no result). Gloo is ``torch.distributed``'s "gloo" backend with
its defaults. gradwire's variants: every algorithm the Python session accepts (when it takes
``algorithm=``; today it has one, the ring) at every loss bound of ``--loss-bounds``.

The machine is shared (2 cores; other people's builds run on it): before each size the ranks
wait, up to ``--quiet-wait`` seconds, until other programs take at most ``--max-other-cpu`` of
the machine, and a case during which they took more is kept but marked ``disturbed``.

Sizes step x4; each size runs ``--iters`` timed operations after ``--warmup`` (fewer above
256 KiB, at least 5 and 1, so a sweep stays bounded). Per case (implementation, variant,
ranks, size, network, link loss, repeat): time per operation p50/p99 (each iteration's time is
the slowest rank's, after a barrier: nccl-tests' convention), algorithm bandwidth (size / p50)
and bus bandwidth (algbw * 2(n-1)/n), frames on the wire and CPU-seconds (the whole machine's
user+nice+system+irq+softirq) per operation, from a loop of back-to-back operations; and
every result checked (see ``allreduce_bench_worker``): a case whose results are wrong or
differ between ranks is a failure with no time.

Writes DIR/allreduce.json (every row, the run's metadata), DIR/allreduce.csv,
DIR/allreduce.png (time and bus bandwidth against size, one line per variant, one row of
panels per network, link loss and rank count), DIR/summary.md (gradwire / Gloo p50 per
size: the median over repeats and their range; CPU-seconds and frames per operation and
their ratios) and the ranks' logs under DIR/logs/. Failed, invalid and disturbed cases are in
the JSON and CSV but not in the ratios, the tables' figures or the plot. A run cut short keeps
the rows its ranks wrote in DIR/logs/*-rows.jsonl. The
fabric needs the gradwire CLI (GRADWIRE_BIN, target/release/gradwire or PATH) and, by the
project's convention, the machine to itself: tests hold /run/gradwire-fabric.lock while they
run this, a person running it by hand takes the same lock (``flock /run/gradwire-fabric.lock
python -m ...``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradwire.experiments import convergence as conv

FULL = {"ranks": "2,4,8", "sizes": "4:64M", "iters": 50, "warmup": 5, "repeats": 2, "counted_target_s": 0.5,
        "quiet_wait_s": 60.0, "peer_timeout_s": 30.0}
# The counted loop's CPU time is read in 10 ms ticks: 0.2 s of it keeps that to a few percent.
QUICK = {"ranks": "2,3", "sizes": "4:1M", "iters": 8, "warmup": 1, "repeats": 1, "counted_target_s": 0.2,
         "quiet_wait_s": 0.0, "peer_timeout_s": 10.0}
# A case during which other programs took more than this share of the machine is "disturbed":
# kept in the JSON, left out of the ratios and the plot.
MAX_OTHER_CPU = 0.10
# Above this size the iterations shrink in proportion, to MIN_ITERS and MIN_WARMUP.
SCALE_FROM = 256 << 10
MIN_ITERS, MIN_WARMUP = 5, 1
# Back-to-back operations of the counted loop: at most this many.
COUNTED_MAX_OPS = 20000
FABRIC_NAME = "arbench"
# The convergence testbed's rate: 4 ranks of Gloo at 200 Mbit/s (~67 k frames/s through the
# switch while 4 busy ranks share the 2 cores with it) left 1.3 % of departures late at 4 MiB
# and 5.6 % at 16 MiB; at 100 Mbit/s under 0.1 %.
FABRIC_RATE = "100Mbit"
MASTER_PORT = 29500  # in the fabric's fresh namespaces nothing else listens
CSV_COLS = ["net", "link_loss", "ranks", "variant", "impl", "algorithm", "loss_bound", "repeat",
            "size_bytes", "iters", "counted_ops", "time_p50_us", "time_p99_us", "time_mean_us",
            "rank0_p50_us", "algbw_GBps", "busbw_GBps", "frames_per_op", "cpu_s_per_op", "checked",
            "correct", "results_identical", "valid", "partial_blocks", "delivered_min", "failure"]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4, 64K, 64M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """``MIN:MAX`` (x4 steps from MIN) or a comma-separated list; multiples of 4 bytes."""
    if ":" in text:
        lo, hi = (parse_size(x) for x in text.split(":", 1))
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 4
    else:
        sizes = [parse_size(x) for x in text.split(",")]
    bad = [s for s in sizes if s < 4 or s % 4]
    if bad or not sizes:
        raise argparse.ArgumentTypeError(f"sizes must be whole float32 elements (multiples of 4 B): {bad or text}")
    return sorted(set(sizes))


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def scaled(n: int, floor: int, size: int) -> int:
    """`n` operations below SCALE_FROM, proportionally fewer above (at least `floor`)."""
    return n if size <= SCALE_FROM else max(min(floor, n), round(n * SCALE_FROM / size))


# -- runs --------------------------------------------------------------------------------------


def reserve_port() -> socket.socket:
    """A TCP port on 127.0.0.1 kept while the socket is open: bound (SO_REUSEADDR), never
    listening, so torch's store can bind it but no port-0 bind gets it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def launch(world: int, cfg_path: Path, out: Path, logdir: Path, tag: str, master: str, port: int,
           ifname: str, netns: list[str] | None) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=master, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=ifname,
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
        cmd = [sys.executable, "-m", "gradwire.experiments.allreduce_bench_worker", "--config", str(cfg_path),
               "--out", str(out)]  # fmt: skip
        if netns:
            cmd = ["ip", "netns", "exec", netns[rank], *cmd]
        with open(logdir / f"{tag}-rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=conv.die_with_parent()))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float, peer_timeout: float) -> str | None:
    """Waits for every rank; an error message when one failed or time ran out (the others
    get the peer timeout to notice before they are killed)."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            return f"timed out after {timeout:.0f} s"
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > 3 * peer_timeout + 10:
            break
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    return None if all(c == 0 for c in codes) else f"worker exit codes {codes}"


def read_rows(path: Path) -> tuple[dict, list[dict]]:
    meta, rows = {}, []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return meta, rows
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if rec.get("kind") == "meta":
            meta = rec
        elif rec.get("kind") == "row":
            rows.append(rec)
    return meta, rows


def fabric_topology(base: Path, ranks: int, loss: float, rate: str, tmp: Path) -> Path:
    """The convergence testbed's shape (its policy, link delay, one switch) with `ranks`
    hosts, `rate` and `loss` on every link, under the name FABRIC_NAME."""
    import tomllib

    spec = tomllib.loads(base.read_text())
    policy = (base.parent / spec["policy"]).resolve()
    text = (f'name = "{FABRIC_NAME}"\npolicy = {json.dumps(str(policy))}\n\n[defaults]\n'
            f'rate = "{rate}"\ndelay = {json.dumps(spec["defaults"]["delay"])}\nloss = {loss!r}\n\n'
            f'[[switch]]\nname = "s0"\n\n[[host]]\nname = "w"\ncount = {ranks}\nuplink = "s0"\n')  # fmt: skip
    out = tmp / f"{FABRIC_NAME}-{ranks}-loss{loss:g}.toml"
    out.write_text(text)
    return out


def run_one(net: str, loss: float, ranks: int, cfg: dict, timeout: float, rate: str, out: Path,
            tmp: Path, fabric: tuple[Path, Path] | None) -> dict:
    """One (network, link loss, ranks) run: every size, variant and repeat. Its record."""
    tag = f"{net}-loss{loss:g}-n{ranks}"
    logdir = out / "logs"
    rows_path = logdir / f"{tag}-rows.jsonl"  # kept: a run cut short keeps the rows it wrote
    cfg_path = tmp / f"{tag}.config.json"
    record: dict[str, Any] = {"net": net, "link_loss": loss, "ranks": ranks, "timeout_s": timeout}
    started = time.monotonic()
    if net == "loopback":
        cfg_path.write_text(json.dumps({**cfg, "net": net, "rate_bps": None}))
        reservation = reserve_port()
        try:
            procs = launch(ranks, cfg_path, rows_path, logdir, tag, "127.0.0.1", reservation.getsockname()[1],
                           "lo", None)
            try:
                record["error"] = wait(procs, timeout, cfg["timeout_s"])
            finally:
                conv._kill(procs)
        finally:
            reservation.close()
    else:
        assert fabric is not None
        binary, base = fabric
        topo = fabric_topology(base, ranks, loss, rate, tmp)
        with conv.Testbed(binary, topo, FABRIC_NAME) as tb:
            record["fabric_sched"] = tb.prioritise_fabric()
            hosts = sorted(tb.hosts(), key=lambda h: (len(h["name"]), h["name"]))
            rate_bps = conv._rate_bps(rate)
            cfg_path.write_text(json.dumps({**cfg, "net": net, "rate_bps": rate_bps,
                                            "fabric": {"binary": str(binary), "name": FABRIC_NAME,
                                                       "pid": tb.record()["pid"]}}))
            procs = launch(ranks, cfg_path, rows_path, logdir, tag, hosts[0]["ip"], MASTER_PORT, "eth0",
                           [h["netns"] for h in hosts])
            try:
                record["error"] = wait(procs, timeout, cfg["timeout_s"])
            finally:
                conv._kill(procs)
            stats = tb.stats()
        lag = (stats or {}).get("lag", {})
        record.update(rate_bps=rate_bps, fabric_behind=lag.get("behind"), fabric_late=lag.get("late"),
                      fabric_departures=lag.get("departures"), fabric_counters=conv._link_counters(stats))
    meta, rows = read_rows(rows_path)
    for r in rows:
        r.update(net=net, link_loss=loss)
    record.update(wall_s=time.monotonic() - started, worker=meta, rows=rows)
    if record.get("error"):
        record["error"] += f" (logs: {logdir}/{tag}-rank*.log)"
    return record


# -- metadata, outputs -------------------------------------------------------------------------


def git(*args: str) -> str | None:
    """`git args` in the checkout this module is in, else in the one the benchmark runs from
    (an installed copy may be outside any checkout); None when neither is one."""
    for where in (Path(__file__).resolve().parent, Path.cwd()):
        try:
            r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=20, cwd=where)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return r.stdout.strip()
    return None


def metadata(argv: list[str]) -> dict:
    import numpy
    import torch

    import gradwire

    native = Path(gradwire._native.__file__)
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m gradwire.experiments.allreduce_bench " + " ".join(argv),
        "kernel": platform.release(), "cpu_count": os.cpu_count(), "cpu_model": model,
        "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
        "gradwire": gradwire.__version__,
        # GRADWIRE_BUILD_COMMIT names the build when the package was built elsewhere than this
        # checkout; otherwise the checkout's HEAD, and whether tracked files differ from it.
        "build_commit": os.environ.get("GRADWIRE_BUILD_COMMIT") or git("rev-parse", "HEAD"),
        "checkout_modified_files": None if dirty is None else len(dirty.splitlines()),
        "native_module": str(native),
        "native_sha256": hashlib.sha256(native.read_bytes()).hexdigest(),
        "native_mtime": datetime.datetime.fromtimestamp(native.stat().st_mtime, datetime.timezone.utc).isoformat(),
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
        "timing": "per iteration the slowest rank's time (each rank times its own call after a barrier); "
                  "p50/p99 over iterations",
        "cpu": "(user+nice+system+irq+softirq) of /proc/stat over a loop of back-to-back operations, "
               "minus the ranks' result checking (thread time), per operation (its two barriers left in)",
        "frames": "loopback: lo packets (/proc/net/dev); fabric: frames the switch received; over the same "
                  "loop, minus its two barriers, per operation",
    }  # fmt: skip


def median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def mark(rows: list[dict], max_other_cpu: float) -> None:
    """Sets each row's ``disturbed`` (other programs took more than `max_other_cpu` of the
    machine during the case) and ``usable`` (correct, valid, timed and not disturbed)."""
    for r in rows:
        r["disturbed"] = (r.get("other_cpu_share") or 0.0) > max_other_cpu
        r["usable"] = bool(r.get("correct") and r.get("valid") and r.get("time_p50_us") is not None
                           and not r["disturbed"])


def why_not(rs: list[dict]) -> str:
    """The table's word for a cell none of whose rows is usable."""
    if any(not r.get("correct") for r in rs):
        return "FAILED"
    if any(not r.get("valid") for r in rs):
        return "invalid"
    return "disturbed" if rs else "-"


def panels(rows: list[dict]) -> list[tuple[str, float, int]]:
    return sorted({(r["net"], r["link_loss"], r["ranks"]) for r in rows}, key=lambda k: (k[0] != "loopback", k))


def ratios(rows: list[dict]) -> list[dict]:
    """gradwire / Gloo per (panel, variant, size) for p50 time, CPU-seconds and frames per
    operation: per repeat (both rows usable), then the median and range over repeats."""
    out = []
    by = {(r["net"], r["link_loss"], r["ranks"], r["variant"], r["size_bytes"], r["repeat"]): r for r in rows}
    repeats = sorted({k[5] for k in by})
    for net, loss, ranks, variant, size in sorted({k[:5] for k in by if k[3] != "gloo"}):
        pairs = [(by.get((net, loss, ranks, "gloo", size, rep)), by.get((net, loss, ranks, variant, size, rep)))
                 for rep in repeats]
        pairs = [(g, w) for g, w in pairs if g and w and g["usable"] and w["usable"]]
        rec: dict[str, Any] = {"net": net, "link_loss": loss, "ranks": ranks, "variant": variant,
                               "size_bytes": size, "repeats": len(pairs)}
        for key, field in (("time", "time_p50_us"), ("cpu", "cpu_s_per_op"), ("frames", "frames_per_op")):
            xs = [w[field] / g[field] for g, w in pairs if g[field]]
            rec.update({f"{key}_ratio": median_or_none(xs), f"{key}_ratio_min": min(xs, default=None),
                        f"{key}_ratio_max": max(xs, default=None)})
        out.append(rec)
    return out


def fmt_size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def fmt_ratio(t: dict | None, key: str) -> str:
    if not t or t[f"{key}_ratio"] is None:
        return ""
    text = f"{t[f'{key}_ratio']:.2f}x"
    if t["repeats"] > 1:
        text += f" [{t[f'{key}_ratio_min']:.2f}-{t[f'{key}_ratio_max']:.2f}]"
    return text


def summary_md(rows: list[dict], table: list[dict]) -> str:
    """Per panel, per size: Gloo's p50 and each gradwire variant's p50 with its ratio to Gloo
    (median over repeats [range]); then CPU-seconds and frames per operation."""
    lines = []
    for net, loss, ranks in panels(rows):
        mine = [r for r in rows if (r["net"], r["link_loss"], r["ranks"]) == (net, loss, ranks)]
        variants = ["gloo"] + sorted({r["variant"] for r in mine if r["impl"] == "gradwire"})
        head = "| size | " + " | ".join(variants) + " |\n" + "|---" * (len(variants) + 1) + "|"
        time_lines, cost_lines = [], []
        for size in sorted({r["size_bytes"] for r in mine}):
            tcells, ccells = [fmt_size(size)], [fmt_size(size)]
            for v in variants:
                rs = [r for r in mine if r["variant"] == v and r["size_bytes"] == size]
                ok = [r for r in rs if r["usable"]]
                t = next((x for x in table if (x["net"], x["link_loss"], x["ranks"], x["variant"], x["size_bytes"])
                          == (net, loss, ranks, v, size)), None)
                if not ok:
                    tcells.append(why_not(rs))
                    ccells.append(why_not(rs))
                    continue
                p50 = statistics.median(r["time_p50_us"] for r in ok)
                ratio = fmt_ratio(t, "time")
                tcells.append(f"{p50:,.0f}" + (f"; **{ratio}**" if ratio else ""))
                cpu = 1e3 * statistics.median(r["cpu_s_per_op"] for r in ok)
                frames = statistics.median(r["frames_per_op"] for r in ok)
                rel = f" ({fmt_ratio(t, 'cpu')}, {fmt_ratio(t, 'frames')})" if t and t["repeats"] else ""
                ccells.append(f"{cpu:.3g} ms, {frames:,.0f} fr{rel}")
            time_lines.append("| " + " | ".join(tcells) + " |")
            cost_lines.append("| " + " | ".join(ccells) + " |")
        title = f"{net}, {loss:.0%} link loss, {ranks} ranks"
        lines += [f"\n**{title}**: time per all-reduce, p50 in us; gradwire/Gloo, median over repeats "
                  "[min-max]\n", head, *time_lines,
                  f"\n**{title}**: CPU-seconds (ms) and frames per all-reduce; gradwire/Gloo\n", head, *cost_lines]
    return "\n".join(lines).lstrip("\n") + "\n"


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLS)
        for r in rows:
            w.writerow([r.get(c) for c in CSV_COLS])


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = panels(rows)
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 3.6 * len(keys)), squeeze=False)
    variants = sorted({r["variant"] for r in rows}, key=lambda v: (v != "gloo", v))
    colors = dict(zip(variants, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    for (ax_t, ax_b), (net, loss, ranks) in zip(axes, keys):
        for v in variants:
            pts = {}
            for r in rows:
                if (r["net"], r["link_loss"], r["ranks"], r["variant"]) == (net, loss, ranks, v) and r["usable"]:
                    pts.setdefault(r["size_bytes"], []).append(r)
            xs = sorted(pts)
            if not xs:
                continue
            style = {"color": colors[v], "marker": "o", "ms": 3, "label": v,
                     "linewidth": 2.5 if v == "gloo" else 1.3}  # fmt: skip
            ax_t.plot(xs, [statistics.median(r["time_p50_us"] for r in pts[x]) for x in xs], **style)
            ax_b.plot(xs, [statistics.median(r["busbw_GBps"] for r in pts[x]) for x in xs], **style)
        for ax, what in ((ax_t, "time per all-reduce, p50 (us)"), (ax_b, "bus bandwidth (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(what)
            ax.set_title(f"{net}, {loss:.0%} link loss, {ranks} ranks", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle("all-reduce: gradwire vs Gloo (median over repeats; failed, invalid and disturbed cases left out)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m gradwire.experiments.allreduce_bench",
                                 description="All-reduce benchmark: gradwire against Gloo, one process per rank.")
    add = ap.add_argument
    add("--out", required=True, help="output directory")
    add("--quick", action="store_true", help="a short sweep (ranks 2,3; 4 B..1 MiB; 8 iterations; no quiet wait)")
    add("--ranks", default=None, help=f"comma-separated rank counts, 2..8 (default {FULL['ranks']})")
    add("--sizes", type=parse_sizes, default=None, help=f"MIN:MAX in x4 steps, or a list (default {FULL['sizes']})")
    add("--iters", type=int, default=None,
        help=f"timed operations per size (default {FULL['iters']}; fewer above 256 KiB)")
    add("--warmup", type=int, default=None, help=f"untimed operations per size (default {FULL['warmup']})")
    add("--repeats", type=int, default=None, help=f"times every case runs, interleaved (default {FULL['repeats']})")
    add("--impl", default="gradwire,gloo", help="gradwire, gloo or both")
    add("--loss-bounds", type=floats, default=[0.0, 0.01], help="gradwire's bounds p (default 0,0.01)")
    add("--algorithms", default=None, help="gradwire algorithms (default: every one the session accepts)")
    add("--net", default="loopback", help="loopback, fabric or both (comma-separated)")
    add("--link-loss", type=floats, default=[0.0], help="fabric link loss fractions (default 0)")
    add("--rate", default=FABRIC_RATE, help=f"fabric link rate (default {FABRIC_RATE})")
    add("--counted-target-s", type=float, default=None, help="seconds of back-to-back operations per case")
    add("--max-other-cpu", type=float, default=MAX_OTHER_CPU,
        help=f"share of the machine other programs may take in a usable case (default {MAX_OTHER_CPU})")
    add("--quiet-wait", type=float, default=None, help="seconds (at most 60) to wait before each size for a quiet "
        f"machine (default {FULL['quiet_wait_s']:g})")
    add("--run-timeout", type=float, default=None, 
        help="seconds per (net, loss, ranks) run (default: from the sweep)")
    add("--bin", default=None, help="gradwire CLI for the fabric (default GRADWIRE_BIN or target/release)")
    return ap.parse_args(argv)


def make_config(a: argparse.Namespace) -> tuple[dict, list[int], list[str]]:
    """The workers' configuration, the rank counts and the networks; exits on a bad option."""
    preset = QUICK if a.quick else FULL
    ranks = [int(x) for x in (a.ranks or preset["ranks"]).split(",")]
    sizes = a.sizes or parse_sizes(preset["sizes"])
    nets, impls = a.net.split(","), a.impl.split(",")
    for bad, what in (([r for r in ranks if not 2 <= r <= 8], "ranks must be 2..8"),
                      ([n for n in nets if n not in ("loopback", "fabric")], "--net: loopback or fabric"),
                      ([i for i in impls if i not in ("gradwire", "gloo")], "--impl: gradwire or gloo"),
                      ([p for p in a.loss_bounds if not 0 <= p < 1], "loss bounds are fractions in [0, 1)"),
                      ([x for x in a.link_loss if not 0 <= x < 1], "link losses are fractions in [0, 1)")):
        if bad:
            sys.exit(f"allreduce_bench: {what}: {bad}")
    iters = a.iters or preset["iters"]
    warmup = preset["warmup"] if a.warmup is None else a.warmup
    cfg = {
        "sizes": sizes, "impls": impls, "loss_bounds": a.loss_bounds,
        "algorithms": a.algorithms.split(",") if a.algorithms else None,
        "iters": {str(s): scaled(iters, MIN_ITERS, s) for s in sizes},
        "warmup": {str(s): scaled(warmup, MIN_WARMUP, s) if warmup else 0 for s in sizes},
        "repeats": a.repeats or preset["repeats"],
        "counted_target_s": a.counted_target_s or preset["counted_target_s"],
        # gradwire's peer timeout: a dead or silent peer fails the case this long after it stopped.
        "counted_max_ops": COUNTED_MAX_OPS, "timeout_s": preset["peer_timeout_s"], "settle_s": 0.5,
        # Below the workers' barrier timeout (3 x the peer timeout): the ranks wait in one.
        "quiet_wait_s": min(60.0, preset["quiet_wait_s"] if a.quiet_wait is None else a.quiet_wait),
        "max_other_cpu": a.max_other_cpu,
    }  # fmt: skip
    return cfg, ranks, nets


def run_timeout(cfg: dict, net: str, rate: str) -> float:
    """A bound on one run, against hangs: generous guesses of a case's fixed cost (a failing
    one waits out the peer timeout), of the slowest variant's bytes per second (loopback
    20 MB/s; fabric a tenth of a link) and of the algorithms the session will offer (3)."""
    bps = 2e7 if net == "loopback" else conv._rate_bps(rate) / 8 / 10
    per_variant = sum(3.0 + cfg["timeout_s"] + s * (cfg["iters"][str(s)] + cfg["warmup"][str(s)] + 2) / bps
                      for s in cfg["sizes"])
    variants = 1 + len(cfg["loss_bounds"]) * (len(cfg["algorithms"] or ()) or 3)
    return 120 + cfg["repeats"] * (variants * per_variant + cfg["quiet_wait_s"] * len(cfg["sizes"]))


def write_outputs(out: Path, doc: dict, runs: list[dict], max_other_cpu: float) -> list[dict]:
    """The JSON, CSV, summary and plot of the runs so far; returns the rows."""
    rows = [r for rec in runs for r in rec["rows"]]
    mark(rows, max_other_cpu)
    table = ratios(rows)
    doc.update(runs=[{k: v for k, v in rec.items() if k != "rows"} for rec in runs], rows=rows, ratios=table)
    (out / "allreduce.json").write_text(json.dumps(doc, indent=1))
    write_csv(out / "allreduce.csv", rows)
    (out / "summary.md").write_text(summary_md(rows, table))
    if rows:
        plot(out / "allreduce.png", rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    from gradwire.experiments import require_extras

    require_extras()
    cfg, ranks, nets = make_config(a)
    fabric = None
    if "fabric" in nets:
        if os.geteuid() != 0:
            sys.exit("allreduce_bench: --net fabric needs root (network namespaces, the emulated fabric)")
        base = conv.find_topology(None)
        fabric = (conv.find_binary(a.bin, base), base)
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, conv._on_signal)
    if fabric:  # a testbed left over from a killed run would make `up` fail
        subprocess.run([str(fabric[0]), "testbed", "down", FABRIC_NAME], capture_output=True, timeout=60)
    doc = {"experiment": "allreduce_bench", **metadata(argv),
           "config": {**cfg, "ranks": ranks, "nets": nets, "link_losses": a.link_loss, "rate": a.rate,
                      "scale_from_bytes": SCALE_FROM}}  # fmt: skip
    runs: list[dict] = []
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="gw-arbench-") as tmp:
            for net in nets:
                for loss in a.link_loss if net == "fabric" else [0.0]:
                    for n in ranks:
                        say(f"{net}, {loss:.0%} link loss, {n} ranks ...")
                        timeout = a.run_timeout or run_timeout(cfg, net, a.rate)
                        runs.append(run_one(net, loss, n, cfg, timeout, a.rate, out, Path(tmp), fabric))
                        say(f"{len(runs[-1]['rows'])} rows in {runs[-1]['wall_s']:.0f} s"
                            + (f"; error: {runs[-1]['error']}" if runs[-1].get("error") else ""))
                        doc["elapsed_s"] = time.monotonic() - t0
                        write_outputs(out, doc, runs, a.max_other_cpu)  # a sweep cut short keeps its runs
    except conv.Interrupted as e:
        say(f"{e}; workers and testbed cleaned up; the runs before it are in {out}, the rows of the one "
            f"cut short in {out}/logs/*-rows.jsonl")
        return 130
    rows = write_outputs(out, doc, runs, a.max_other_cpu)
    print((out / "summary.md").read_text(), file=sys.stderr)
    failed = [r for r in rows if not r.get("correct")]
    for r in failed:
        say(f"FAILED {r['net']} {r['link_loss']:.0%} n={r['ranks']} {r['variant']} {fmt_size(r['size_bytes'])}: "
            f"{r['failure']}")
    say(f"wrote {out}/allreduce.json, .csv, .png, summary.md in {doc['elapsed_s']:.0f} s")
    return 0 if rows and not failed and not any(rec.get("error") for rec in runs) else 1


def say(text: str) -> None:
    print(f"allreduce_bench: {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
