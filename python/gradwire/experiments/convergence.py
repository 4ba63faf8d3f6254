"""Convergence on the emulated fabric: PyTorch's Gloo all-reduce against gradwire's (root).

    python -m gradwire.experiments.convergence --out DIR [--workload digits|charlm]
        [--workers N] [--epochs N] [--quick]

Data-parallel workers (4 by default), each a process in its own network namespace of the
testbed ``testbeds/convergence.toml`` (hosts on one emulated switch), train a workload of
``gradwire.experiments.workloads`` with DDP: a small CNN on scikit-learn's digits, or a
character-level transformer language model on a text the package ships. Variants: ``gloo``
(DDP's own all-reduce over TCP, the baseline), gradwire's DDP hook at p = 0, 1 % and 10 %
(``gradwire-p0``, ``-p1``, ``-p10``) and ``init_process_group("gradwire")`` with DDP
unchanged (``backend-p0``, ``backend-p10``), each at the link losses asked for (0 and 2 % by
default) on every fabric link. Every run gets a fresh testbed, so its fabric counters (did the
emulator keep its clock: ``valid``) are its own.

The targets are judged only on runs that are valid and have every rank's result; a run that
is not is listed under ``excluded_runs`` with the reasons, and a target that needs it is not
met. Accuracy is judged on the worst rank: with a loss bound the ranks' models can differ.

Writes DIR/convergence.json, DIR/convergence.csv, DIR/convergence.png and the workers' logs
under DIR/logs/. The gradwire binary comes from GRADWIRE_BIN, the repository's
target/release/gradwire (``cargo build --release -p gradwire-cli``; under $CARGO_TARGET_DIR
when that is set) or PATH.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from gradwire.experiments.convergence_report import (  # noqa: F401 -- the experiment's API
    excluded_runs,
    exclusion_reasons,
    plot,
    run_tag,
    targets,
    write_csv,
)

VARIANTS = {
    "gloo": None,
    "gradwire-p0": 0.0,
    "gradwire-p1": 0.01,
    "gradwire-p10": 0.10,
    # init_process_group("gradwire") with DDP unchanged, the group's loss bound p
    "backend-p0": 0.0,
    "backend-p10": 0.10,
}
QUICK_VARIANTS = ("gloo", "gradwire-p1")
LINK_LOSSES = (0.0, 0.02)
TOPOLOGY = "testbeds/convergence.toml"
FULL_EPOCHS = {"digits": 20, "charlm": 10}
QUICK_EPOCHS = 2
# What the JSON records of each workload's set-up.
WORKLOAD_CONFIG = {
    "digits": {
        "lr": 0.1, "optimizer": "SGD momentum 0.9, cosine",
        "model": "DigitsCNN (conv16-conv32-pool-fc64-fc10, 38 k params)",
        "dataset": "sklearn load_digits, 20% stratified test split (360 images), seed 0",
    },
    "charlm": {
        "lr": 0.01, "optimizer": "AdamW, cosine",
        "model": "CharLM (2 pre-norm causal transformer blocks, width 64, 4 heads, context 64, 118 k params)",
        "dataset": "gradwire/experiments/data/charlm.txt (171 kB of the project's docs), last 10% held out, "
                   "40 iterations of random windows an epoch",
    },
}
# Iterations an epoch at 4 workers (digits: its training split over a global batch of 64).
ITERS_PER_EPOCH = {"digits": 22, "charlm": 40}
MASTER_PORT = 29500
# The hook's priority classes: one, so each iteration is one all-reduce. On one switch with
# nothing else on it the per-layer DSCPs change nothing, and each class costs a ring of flows:
# with the default 7 classes (4 all-reduces for the CNN's 4 layers) gradwire-p0 took 62 ms an
# iteration at 0 % loss, with 1 class 45 ms (3-epoch runs, Gloo 30 ms).
PRIORITY_CLASSES = 1
# gradwire's peer timeout inside a run: a dead peer fails the run this long after it died.
PEER_TIMEOUT_S = 20.0
FABRIC_RT_PRIORITY = 10


class Interrupted(Exception):
    """SIGTERM/SIGINT/SIGHUP: unwind through every cleanup."""


def _on_signal(signum, _frame):
    raise Interrupted(f"interrupted by signal {signum}")


def _repo_candidates() -> list[Path]:
    here = Path(__file__).resolve()
    roots = [Path.cwd(), *Path.cwd().parents, *here.parents]
    env = os.environ.get("GRADWIRE_REPO")
    return ([Path(env)] if env else []) + roots


def find_topology(given: str | None) -> Path:
    if given:
        p = Path(given)
        if not p.is_file():
            sys.exit(f"convergence: no topology file {p}")
        return p.resolve()
    for root in _repo_candidates():
        p = root / TOPOLOGY
        if p.is_file():
            return p.resolve()
    sys.exit(
        f"convergence: cannot find {TOPOLOGY}: run from the gradwire repository, or give "
        "--topology FILE or GRADWIRE_REPO"
    )


def find_binary(given: str | None, topology: Path) -> Path:
    cands = [given, os.environ.get("GRADWIRE_BIN")]
    target = os.environ.get("CARGO_TARGET_DIR", "target")  # cargo's own default
    cands.append(str(topology.parent.parent / target / "release" / "gradwire"))
    cands.append(shutil.which("gradwire"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return Path(c).resolve()
    sys.exit(
        "convergence: no gradwire binary: run `cargo build --release -p gradwire-cli` in the "
        "repository, or set GRADWIRE_BIN"
    )


def lossy_topology(lossless: Path, loss: float, tmp: Path, workers: int | None = None) -> Path:
    """A copy of `lossless` with `loss` on every link (its [defaults] loss line) and, when
    given, `workers` hosts (its one [[host]] count line), the policy path made absolute: the
    lossless file stays the one source of truth."""
    text = lossless.read_text()
    spec = tomllib.loads(text)
    if spec.get("link") or any("loss" in h for h in spec.get("host", [])):
        sys.exit(f"convergence: {lossless} sets links of its own; only [defaults] loss is rewritten")
    # [defaults] is the only table with a `loss` line, checked below by re-reading.
    new, n = re.subn(r"(?m)^loss\s*=.*$", f"loss = {loss!r}", text)
    if n != 1:
        sys.exit(f"convergence: {lossless} needs exactly one `loss = ...` line in [defaults]")
    if workers is not None:
        new, n = re.subn(r"(?m)^count\s*=.*$", f"count = {workers}", new)
        if n != 1 or len(spec.get("host", [])) != 1:
            sys.exit(f"convergence: {lossless} needs one [[host]] table with a `count = ...` line")
    policy = (lossless.parent / spec["policy"]).resolve()
    new = re.sub(r'(?m)^policy\s*=.*$', f"policy = {json.dumps(str(policy))}", new)
    out = tmp / f"{lossless.stem}-{workers or 'n'}w-loss{loss:g}.toml"
    out.write_text(new)
    if tomllib.loads(new)["defaults"]["loss"] != loss:
        sys.exit(f"convergence: could not set the loss of {lossless}")
    return out


class Testbed:
    """`gradwire testbed up` in a with-block: always `down`, whatever happens inside."""

    def __init__(self, binary: Path, topology: Path, name: str) -> None:
        self.binary, self.topology, self.name = binary, topology, name
        self.up = False

    def _run(self, *args: str, timeout: float = 60.0) -> str:
        r = subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, timeout=timeout
        )
        if r.returncode != 0:
            raise RuntimeError(f"gradwire {' '.join(args)} failed: {r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def record(self) -> dict:
        for tb in json.loads(self._run("testbed", "status", "--json")):
            if tb["name"] == self.name:
                if not tb.get("running"):
                    raise RuntimeError(f"testbed {self.name}: its fabric is not running")
                return tb
        raise RuntimeError(f"testbed {self.name} is not up")

    def hosts(self) -> list[dict]:
        return self.record()["hosts"]

    def prioritise_fabric(self) -> str:
        """Real-time scheduling for the fabric's threads: the emulated switch must not wait
        for a core behind the 4 workers (it sleeps in ppoll when idle, so it takes only what
        it forwards). Returns what was done, for the record."""
        pid = self.record()["pid"]
        done = 0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(FABRIC_RT_PRIORITY))
                done += 1
        except OSError as e:
            return f"not prioritised ({e})"
        return f"SCHED_FIFO {FABRIC_RT_PRIORITY} on {done} threads"

    def stats(self) -> dict | None:
        try:
            return json.loads(self._run("fabric", "stats", self.name, "--json"))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            return None

    def __enter__(self) -> "Testbed":
        self.up = True  # a half-built testbed is still taken down
        self._run("testbed", "up", str(self.topology), timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        if self.up:
            subprocess.run(
                [str(self.binary), "testbed", "down", self.name],
                capture_output=True,
                timeout=60,
            )
            self.up = False


PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child (dlopen there is not safe).
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def die_with_parent(sig: int = signal.SIGKILL):
    """A preexec_fn: the child gets `sig` when this process dies, however it dies (a SIGKILL
    runs none of our cleanup). ``ip netns exec`` execs its command without forking, so the
    request reaches the worker itself. The signal follows the forking thread: call it from the
    main thread. If we died before the request took effect, the child stops at once."""
    parent = os.getpid()

    def preexec() -> None:
        if _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)

    return preexec


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_one(
    binary: Path,
    topology: Path,
    name: str,
    variant: str,
    link_loss: float,
    workload: str,
    epochs: int,
    run_timeout: float,
    rate_bps: int,
    priority_classes: int,
    tcp_rto_min_ms: int | None,
    workdir: Path,
    logdir: Path,
) -> dict:
    """One variant on a fresh testbed; the record of convergence.json."""
    tag = f"{variant}-loss{link_loss:g}"
    record: dict = {"variant": variant, "link_loss": link_loss, "completed": False}
    started = time.monotonic()
    with Testbed(binary, topology, name) as tb:
        record["fabric_sched"] = tb.prioritise_fabric()
        hosts = sorted(tb.hosts(), key=lambda h: h["name"])
        if tcp_rto_min_ms is not None:
            for h in hosts:
                _set_rto_min(h["netns"], tcp_rto_min_ms)
        world = len(hosts)
        master = hosts[0]["ip"]
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for rank, h in enumerate(hosts):
                env = dict(
                    os.environ,
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_RANK="0",
                    LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR=master,
                    MASTER_PORT=str(MASTER_PORT),
                    GLOO_SOCKET_IFNAME="eth0",  # the host's uplink in its namespace
                    OMP_NUM_THREADS="1",
                    PYTHONUNBUFFERED="1",
                )
                env.pop("GRADWIRE_IP", None)  # the hook finds the address that routes to the master
                cmd = [
                    "ip", "netns", "exec", h["netns"],
                    sys.executable, "-m", "gradwire.experiments.convergence_worker",
                    "--variant", variant,
                    "--workload", workload,
                    "--epochs", str(epochs),
                    "--timeout", str(PEER_TIMEOUT_S),
                    "--out", str(workdir / f"{tag}-rank{rank}.json"),
                ]  # fmt: skip
                if VARIANTS[variant] is not None:
                    cmd += ["--loss-bound", str(VARIANTS[variant]), "--rate-bps", str(rate_bps),
                            "--priority-classes", str(priority_classes)]
                log = open(logdir / f"{tag}-rank{rank}.log", "w")
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                        preexec_fn=die_with_parent(),
                    )
                )
            busy0 = _busy_cpu_s()
            deadline = time.monotonic() + run_timeout
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    record["error"] = f"timed out after {run_timeout:.0f} s"
                    break
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                # The others of a failed rank fail within the peer timeout; then give up.
                if failed_at is not None and now - failed_at > PEER_TIMEOUT_S + 10:
                    break
                time.sleep(0.2)
            codes = [p.poll() for p in procs]
            busy = _busy_cpu_s() - busy0
            stats = tb.stats()
            record["host_counters"] = _host_counters([h["netns"] for h in hosts])
        finally:
            _kill(procs)
            for log in logs:
                log.close()
    record["wall_s"] = time.monotonic() - started
    if any(c != 0 for c in codes):
        record.setdefault("error", f"worker exit codes {codes} (logs in {logdir})")
    ranks = _rank_outputs(workdir, tag, world)
    record["completed"] = len(ranks) == world and all(c == 0 for c in codes)
    lag = (stats or {}).get("lag", {})
    record["fabric"] = {
        "behind": lag.get("behind"),
        "late": lag.get("late"),
        "departures": lag.get("departures"),
        "lag_p99_us": lag["p99_ns"] / 1e3 if "p99_ns" in lag else None,
        "lag_worst_us": lag["worst_ns"] / 1e3 if "worst_ns" in lag else None,
        **_link_counters(stats),
    }
    # Was the machine ours? CPU time spent while the workers ran, and how much of it the
    # workers and the fabric's loop account for (the rest: other processes, and kernel work
    # such as softirqs charged to nobody here).
    workers_cpu = sum(r.get("cpu_s", 0.0) for r in ranks)
    fabric_cpu = (stats or {}).get("loop_cpu_s", 0.0)
    record["machine"] = {
        "busy_cpu_s": busy,
        "workers_cpu_s": workers_cpu,
        "fabric_loop_cpu_s": fabric_cpu,
        "other_cpu_s": busy - workers_cpu - fabric_cpu,
        "cores": os.cpu_count(),
    }
    invalid = []
    if not record["completed"]:
        invalid.append("not completed: " + record.get("error", "a rank wrote no result"))
    if stats is None:
        invalid.append("no fabric counters (fabric stats failed)")
    elif lag.get("behind") is not False:
        invalid.append(f"the emulated fabric fell behind its clock (behind = {lag.get('behind')!r})")
    record["invalid_reasons"] = invalid
    record["valid"] = not invalid
    record["world"] = world
    by_rank = sorted(ranks, key=lambda r: r["rank"])
    record["ranks_reported"] = [r["rank"] for r in by_rank]
    record["rank_final_accuracy"] = [
        r["accuracy_per_epoch"][-1] if r["accuracy_per_epoch"] else None for r in by_rank
    ]
    record["rank_final_loss"] = [
        r["loss_per_epoch"][-1] if r.get("loss_per_epoch") else None for r in by_rank
    ]
    if ranks:
        r0 = next((r for r in ranks if r["rank"] == 0), ranks[0])
        w = r0["warmup_iterations"]
        per_rank_ms = [statistics.fmean(r["iteration_ms"][w:]) for r in ranks if len(r["iteration_ms"]) > w]
        all_ms = sorted(ms for r in ranks for ms in r["iteration_ms"][w:])
        record.update(
            final_accuracy=r0["accuracy_per_epoch"][-1] if r0["accuracy_per_epoch"] else None,
            accuracy_per_epoch=r0["accuracy_per_epoch"],
            final_loss=r0["loss_per_epoch"][-1] if r0.get("loss_per_epoch") else None,
            loss_per_epoch=r0.get("loss_per_epoch", []),
            epoch_end_s=r0.get("epoch_end_s", []),
            iteration_ms_mean=statistics.fmean(per_rank_ms) if per_rank_ms else None,
            iteration_ms_p50=_pct(all_ms, 0.50),
            iteration_ms_p99=_pct(all_ms, 0.99),
            delivered_fraction_mean=statistics.fmean(r["delivered_fraction_mean"] for r in ranks),
            delivered_fraction_min=min(r["delivered_fraction_min"] for r in ranks),
            replica_drift=max(r.get("replica_drift", math.nan) for r in ranks),
            iterations=r0["iterations"],
            train_s=r0["train_s"],
        )
        if "delivered_by_parameter" in r0:
            names = list(r0["delivered_by_parameter"])
            record["delivered_by_parameter"] = {
                n: statistics.fmean(r["delivered_by_parameter"][n] for r in ranks) for n in names
            }
            record["layers"] = r0["layers"]
            record["allreduce_calls_per_iteration"] = r0["allreduce_calls"] / max(r0["iterations"], 1)
            record["allreduce_ms_mean"] = 1e3 * r0["allreduce_s"] / max(r0["iterations"], 1)
    else:
        record.update(final_accuracy=None, accuracy_per_epoch=[], iteration_ms_mean=None,
                      delivered_fraction_mean=None)
    return record


def _set_rto_min(netns: str, ms: int) -> None:
    """Every route of the host gets TCP's rto_min (it also bounds the tail-loss probe of a
    lone segment): a diagnostic of how much TCP's timers cost, for both transports."""
    routes = json.loads(
        subprocess.run(["ip", "-n", netns, "-j", "route", "show"], capture_output=True, text=True,
                       check=True, timeout=10).stdout
    )
    for r in routes:
        cmd = ["ip", "-n", netns, "route", "change", r["dst"]]
        if "gateway" in r:
            cmd += ["via", r["gateway"]]
        cmd += ["dev", r["dev"], *r.get("flags", []), "rto_min", f"{ms}ms"]
        subprocess.run(cmd, capture_output=True, check=True, timeout=10)


def _rank_outputs(workdir: Path, tag: str, world: int) -> list[dict]:
    ranks = []
    for rank in range(world):
        try:
            ranks.append(json.loads((workdir / f"{tag}-rank{rank}.json").read_text()))
        except (OSError, ValueError):
            pass
    return ranks


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _pct(sorted_ms: list[float], q: float) -> float | None:
    if not sorted_ms:
        return None
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


# Kernel counters summed over the hosts' namespaces (fresh per run): TCP's retransmissions and
# timeouts (Gloo's data, gradwire's control channel) and UDP's drops (gradwire's data).
HOST_COUNTERS = {
    "Tcp": ("OutSegs", "RetransSegs"),
    "TcpExt": ("TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSlowStartRetrans"),
    "Udp": ("InDatagrams", "OutDatagrams", "RcvbufErrors", "InErrors"),
}


def _host_counters(namespaces: list[str]) -> dict:
    out: dict[str, int] = {}
    for ns in namespaces:
        try:
            text = subprocess.run(
                ["ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat"],
                capture_output=True, text=True, timeout=10,
            ).stdout
        except subprocess.TimeoutExpired:
            continue
        lines = text.splitlines()
        for head, vals in zip(lines, lines[1:]):
            hk, _, hnames = head.partition(":")
            vk, _, hvals = vals.partition(":")
            if hk != vk or hk not in HOST_COUNTERS or not hvals.strip()[:1].lstrip("-").isdigit():
                continue
            for name, value in zip(hnames.split(), hvals.split()):
                if name in HOST_COUNTERS[hk]:
                    key = f"{hk}.{name}"
                    out[key] = out.get(key, 0) + int(value)
    return out


def _link_counters(stats: dict | None) -> dict:
    """Frames the fabric delivered and lost on its links, summed over ports."""
    if not stats:
        return {}
    out = {"frames_forwarded": 0, "link_delivered": 0, "link_lost": 0, "dropped": 0, "marked": 0}
    for sw in stats.get("switches", []):
        out["frames_forwarded"] += sw.get("forward", {}).get("forwarded", 0)
        for port in sw.get("ports", []):
            eg = port.get("egress", {})
            out["link_delivered"] += eg.get("delivered_pkts", 0)
            out["link_lost"] += eg.get("lost_pkts", 0)
            for q in eg.get("queues", []):
                out["dropped"] += q.get("dropped_threshold", 0) + q.get("dropped_buffer", 0)
                out["marked"] += q.get("marked", 0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gradwire.experiments.convergence",
        description="Gloo vs gradwire DDP training on the emulated fabric (root).",
    )
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--workload", default="digits", choices=sorted(FULL_EPOCHS),
                    help="digits (CNN, accuracy) or charlm (transformer LM on a shipped text, loss)")
    ap.add_argument("--workers", type=int, default=None, help="workers (default: the topology's hosts, 4)")
    ap.add_argument("--epochs", type=int, default=None, help=f"epochs (default {FULL_EPOCHS}; --quick {QUICK_EPOCHS})")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_EPOCHS} epochs, variants {', '.join(QUICK_VARIANTS)}")
    ap.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--link-losses", default=None, help="comma-separated link loss fractions (default 0,0.02)")
    ap.add_argument("--topology", default=None, help=f"lossless topology (default {TOPOLOGY})")
    ap.add_argument("--bin", default=None, help="gradwire binary (default GRADWIRE_BIN or target/release)")
    ap.add_argument("--rate-bps", type=int, default=None, help="gradwire senders' line rate (default: the topology's link rate)")
    ap.add_argument("--priority-classes", type=int, default=PRIORITY_CLASSES,
                    help=f"the hook's coalescing classes, 1..7 (default {PRIORITY_CLASSES})")
    ap.add_argument("--tcp-rto-min-ms", type=int, default=None,
                    help="diagnostic: TCP rto_min on every host's routes (default: the kernel's 200 ms)")
    ap.add_argument("--run-timeout", type=float, default=None, help="seconds per run before it is killed")
    a = ap.parse_args(argv)
    from gradwire.experiments import require_extras

    require_extras()

    if os.geteuid() != 0:
        sys.exit("convergence: needs root (it builds network namespaces and runs the emulated fabric)")
    epochs = a.epochs or (QUICK_EPOCHS if a.quick else FULL_EPOCHS[a.workload])
    if a.workers is not None and not 2 <= a.workers <= 64:
        sys.exit(f"convergence: --workers {a.workers} is not in 2..64")
    variants = a.variants.split(",") if a.variants else list(QUICK_VARIANTS if a.quick else VARIANTS)
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"convergence: unknown variant {v!r}; one of {', '.join(VARIANTS)}")
    losses = [float(x) for x in a.link_losses.split(",")] if a.link_losses else list(LINK_LOSSES)
    for loss in losses:
        if not 0.0 <= loss < 1.0:
            sys.exit(f"convergence: link loss {loss} is not a fraction in [0, 1)")
    topology = find_topology(a.topology)
    binary = find_binary(a.bin, topology)
    spec = tomllib.loads(topology.read_text())
    name = spec["name"]
    rate_bps = a.rate_bps or _rate_bps(spec["defaults"]["rate"])
    world = a.workers or sum(h.get("count", 1) for h in spec.get("host", []))
    # ~0.15 s per iteration at 4 workers at worst (Gloo under loss), slower with more workers
    # on this machine's 2 cores, plus start-up.
    run_timeout = a.run_timeout or 60.0 + epochs * ITERS_PER_EPOCH[a.workload] * 0.15 * max(world, 4)
    out = Path(a.out)
    logdir = out / "logs"
    logdir.mkdir(parents=True, exist_ok=True)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _on_signal)
    # A testbed of this name left over from a killed run would make `up` fail.
    subprocess.run([str(binary), "testbed", "down", name], capture_output=True, timeout=60)

    results = []
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="gw-convergence-") as tmp:
            tmp = Path(tmp)
            for loss in losses:
                same = loss == 0.0 and a.workers is None
                topo = topology if same else lossy_topology(topology, loss, tmp, a.workers)
                for v in variants:
                    print(f"convergence: {v} at {loss:.0%} link loss ...", file=sys.stderr, flush=True)
                    r = run_one(binary, topo, name, v, loss, a.workload, epochs, run_timeout, rate_bps, a.priority_classes,
                                a.tcp_rto_min_ms, tmp, logdir)
                    results.append(r)
                    print(
                        f"convergence: {v} at {loss:.0%}: accuracy {_fmt(r.get('final_accuracy'), 100, '%')}"
                        f", iteration {_fmt(r.get('iteration_ms_mean'), 1, ' ms')}, delivered "
                        f"{_fmt(r.get('delivered_fraction_mean'), 1, '')}, valid {r['valid']}"
                        + (f", error: {r['error']}" if r.get("error") else ""),
                        file=sys.stderr, flush=True,
                    )
    except Interrupted as e:
        print(f"convergence: {e}; testbed and workers cleaned up", file=sys.stderr)
        return 130
    doc = {
        "experiment": "convergence",
        "command": "python -m gradwire.experiments.convergence " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            "workload": a.workload, "world": world, "epochs": epochs, "batch_per_rank": 16,
            **WORKLOAD_CONFIG[a.workload],
            "topology": str(topology), "link_rate_bps": _rate_bps(spec["defaults"]["rate"]),
            "gradwire_rate_bps": rate_bps, "gradwire_priority_classes": a.priority_classes,
            "link_losses": losses, "fabric_scheduling": f"SCHED_FIFO {FABRIC_RT_PRIORITY}",
            "tcp_rto_min_ms": a.tcp_rto_min_ms,
            "warmup_iterations_excluded": 2,
        },
        "elapsed_s": time.monotonic() - t0,
        "results": results,
        "excluded_runs": excluded_runs(results),
        "targets": targets(results, a.workload),
    }
    (out / "convergence.json").write_text(json.dumps(doc, indent=2))
    write_csv(out / "convergence.csv", results)
    plot(out / "convergence.png", results, epochs, a.workload, world)
    print(f"convergence: wrote {out}/convergence.json, .csv, .png in {doc['elapsed_s']:.0f} s", file=sys.stderr)
    for t in doc["targets"]:
        if t.get("value_pp") is not None:
            fig = f"{t['value_pp']:+.2f} pp"
        elif t.get("value_pct") is not None:
            fig = f"{t['value_pct']:+.2f} %"
        elif t.get("value_ratio") is not None:
            fig = f"{t['value_ratio']:.2f}x"
        elif t.get("value_drift") is not None:
            fig = f"drift {t['value_drift']:g}"
        else:
            fig = "no figure"
        why = "".join(f"; {e['run']} excluded: {', '.join(e['reasons'])}" for e in t["excluded"])
        print(f"  {'MET' if t['met'] else 'NOT JUDGED' if not t['judged'] else 'NOT MET'}: {t['target']}: {fig}{why}",
              file=sys.stderr)
    return 0 if all(r["completed"] for r in results) else 1


def _fmt(v, scale, unit):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.2f}{unit}"


def _rate_bps(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)(bit)?\s*", text)
    if not m:
        sys.exit(f"convergence: cannot read the link rate {text!r}; give --rate-bps")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


if __name__ == "__main__":
    sys.exit(main())
