"""DDP iteration time: Gloo against gradwire's backend and gradwire's hook, in one run.

    python -m gradwire.experiments.ddp_bench --out results/ddp-bench

Modes (each a DDP job of ``--world`` ranks on 127.0.0.1, the same model, data and seed):

- ``gloo``: ``DistributedDataParallel`` on a Gloo group (PyTorch as people run it);
- ``gradwire``: ``init_process_group("gradwire")`` and DDP unchanged (no hook), and
  ``gradwire-mtu64k`` the same with ``Options(mtu=65000)``: loopback's MTU is 65536, and
  TCP (Gloo) fills it, while gradwire's default segments are Ethernet's 1500 bytes;
- ``hook``: Gloo's group with gradwire's communication hook (``gradwire.ddp``), default
  buckets (25 MB), and ``hook-1mb`` (``bucket_cap_mb=1``: many buckets in flight) against
  ``hook-1bucket`` (one bucket: nothing to overlap).

The modes are interleaved round by round (so drift in the machine's load hits all alike);
each round's figure is the median iteration time after warm-up, and the report gives the
median and spread over rounds, the ratios the issue's targets name, the system-wide CPU
busy share during each run (/proc/stat), and whether the modes trained to the same
parameters (the backend must be bit-identical to Gloo on two ranks).

Writes ``results.json``, ``results.csv`` and ``ddp_bench.png`` into ``--out`` (and the
ranks' own outputs and logs of the latest round into ``--out/runs``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("gloo", "gradwire", "gradwire-mtu64k", "hook", "hook-1mb", "hook-1bucket")


def _busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str, a: argparse.Namespace, workdir: Path) -> dict:
    """One DDP job of `mode`; its ranks' outputs and the CPU busy share."""
    port = _free_port()
    procs, outs = [], []
    b0, t0 = _busy_jiffies()
    for rank in range(a.world):
        out = workdir / f"{mode}-rank{rank}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(a.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
        )
        env.pop("GRADWIRE_IP", None)
        cmd = [sys.executable, "-m", "gradwire.experiments.ddp_bench", "--worker", mode,
               "--iters", str(a.iters), "--out", str(out), "--model", a.model]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=open(workdir / f"{mode}-rank{rank}.log", "w")))  # fmt: skip
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    b1, t1 = _busy_jiffies()
    ranks = []
    for out in outs:
        try:
            ranks.append(json.loads(out.read_text()))
        except (OSError, ValueError):
            ranks.append(None)
    ok = all(r is not None for r in ranks) and all(p.returncode == 0 for p in procs)
    return {
        "mode": mode,
        "ok": ok,
        "iteration_ms": max(r["median_ms"] for r in ranks) if ok else None,
        "checksum": ranks[0]["checksum"] if ok else None,
        "ranks_agree": ok and len({r["checksum"] for r in ranks}) == 1,
        "cpu_busy_share": (b1 - b0) / max(1, t1 - t0),
    }


def _model(name: str):
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(
            nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10),
        )  # fmt: skip
    raise SystemExit(f"unknown model {name!r}: mlp")


def worker(mode: str, iters: int, out: Path, model_name: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradwire.ddp as gwddp
    import gradwire.distributed as gwd

    torch.set_num_threads(1)
    if mode.startswith("gradwire"):
        opts = gwd.Options(mtu=65000) if mode == "gradwire-mtu64k" else None
        dist.init_process_group(gwd.BACKEND, pg_options=opts)
        group = None
    else:
        dist.init_process_group("gloo")
        group = None
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = _model(model_name)
    cap = {"hook-1mb": 1.0, "hook-1bucket": 10_000.0}.get(mode, 25.0)
    ddp = DDP(net, process_group=group, bucket_cap_mb=cap)
    state = None
    if mode.startswith("hook"):
        state = gwddp.GradwireState(ddp, ip="127.0.0.1")
        ddp.register_comm_hook(state, gwddp.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    warm = sorted(times[max(1, iters // 5) :])
    checksum = float(sum(p.double().sum().item() for p in net.parameters()))
    out.write_text(json.dumps({"median_ms": 1000 * warm[len(warm) // 2], "checksum": checksum}))
    if state is not None:
        state.close()
    sys.stdout.flush()
    os._exit(0)


def summarize(rows: list[dict]) -> dict:
    by = {m: [r["iteration_ms"] for r in rows if r["mode"] == m and r["ok"]] for m in MODES}
    med = {m: statistics.median(v) if v else None for m, v in by.items()}

    def ratio(x: str, y: str):
        if med[x] is None or med[y] is None:
            return None
        per_round = [a / b for a, b in zip(by[x], by[y])]
        return {"median": med[x] / med[y], "min": min(per_round), "max": max(per_round)}

    return {
        "median_ms": med,
        "spread_ms": {m: [min(v), max(v)] if v else None for m, v in by.items()},
        "gradwire_over_gloo": ratio("gradwire", "gloo"),
        "gradwire_mtu64k_over_gloo": ratio("gradwire-mtu64k", "gloo"),
        "hook_over_gloo": ratio("hook", "gloo"),
        "hook_1mb_over_1bucket": ratio("hook-1mb", "hook-1bucket"),
        "backend_bit_identical_to_gloo": all(
            g["checksum"] == b["checksum"]
            for mode in ("gradwire", "gradwire-mtu64k")
            for g, b in zip(
                [r for r in rows if r["mode"] == "gloo"], [r for r in rows if r["mode"] == mode]
            )
        ),
        "failed_runs": [r["mode"] for r in rows if not r["ok"]],
    }


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, m in enumerate(MODES):
        v = [r["iteration_ms"] for r in rows if r["mode"] == m and r["ok"]]
        if v:
            ax.bar(i, statistics.median(v), color="tab:blue" if "hook" in m else "tab:gray")
            ax.plot([i] * len(v), v, "k.", ms=4)
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set_ylabel("DDP iteration, ms (median; dots: rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="results directory")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.iters, a.out, a.model)
        return 0
    if a.out is None:
        ap.error("--out is required")
    from gradwire.experiments import require_extras

    require_extras()
    a.out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in a.modes.split(",") if m]
    runs = a.out / "runs"  # each run's ranks' outputs and logs (the latest round's)
    runs.mkdir(exist_ok=True)
    rows = []
    for rnd in range(a.rounds):
        for m in modes:
            r = run_mode(m, a, runs)
            r["round"] = rnd
            rows.append(r)
            print(f"round {rnd} {m}: {r['iteration_ms'] and round(r['iteration_ms'], 1)} ms "
                  f"ok={r['ok']} cpu={r['cpu_busy_share']:.2f}", flush=True)  # fmt: skip
    doc = {"args": {k: str(v) for k, v in vars(a).items()}, "runs": rows, "summary": summarize(rows)}
    (a.out / "results.json").write_text(json.dumps(doc, indent=2))
    with open(a.out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["round", "mode", "ok", "iteration_ms", "cpu_busy_share", "ranks_agree", "checksum"])  # fmt: skip
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in w.fieldnames})
    plot(a.out / "ddp_bench.png", rows)
    print(json.dumps(doc["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
