"""The README's collective job with PyTorch's Gloo instead of gradwire (root).

    python -m gradwire.experiments.job_gloo --job collective/jobs/racks8.toml --iterations 20 --out DIR
        [--model control/models/resnet50.toml] [--scale 0.01] [--timeout 60] [--deadline 600]

What ``gradwire job run FILE`` does, with ``torch.distributed``'s "gloo" backend at its
defaults doing the all-reduces:

- **Network**: one network namespace per distinct host address of the job file, each with
  ``gw0`` (MTU 1500, the netns kit's MAC ``02:67:77:00:xx:xx``) on one Linux bridge ``br0``
  (STP off, no forward delay, no multicast snooping) in a switch namespace; the job's
  addresses with prefix length 15 (all of 198.18.0.0/15 on the bridge), permanent neighbour
  entries for the other hosts, IPv6 off. This is job/src/run.rs ``build_namespaces``
  repeated with ``ip`` commands. Namespace names are the kit's temporary ones
  (``gw<pid>t<n>h<i>``, ``gw<pid>t<n>sw``), a reaper removes them if this process is killed,
  and a ``finally`` removes them on every other path.
- **Ranks**: one process per rank in its host's namespace, with torchrun's variables
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` from the job
  file's ``master``), ``GLOO_SOCKET_IFNAME=gw0`` (so Gloo uses the job's address) and
  ``OMP_NUM_THREADS=1`` (what torchrun sets for several processes per machine); they die with
  this process, the first failure stops the others, and the whole run has a deadline.
- **Workload**: the model file's layers at ``--scale`` exactly as job/src/workload.rs
  ``model_layers`` computes them (``round(params * scale)``, half away from zero, at least 1),
  one ``dist.all_reduce`` (sum) per layer per iteration, in layer order. Rank r's element e of
  layer l is ``((r % 23) * 7 + (l % 23) * 5 + (e % 23) * 3) % 23 - 11`` (workload.rs
  ``input``), and every element of every result must be exactly the sum over all ranks
  (``residue_sums``), else the rank fails naming the iteration, layer and element.
- **Timing**: as the gradwire worker: per rank, the wall time of each iteration (filling the
  tensors, the all-reduces, checking every element); the rendezvous and the final barrier are
  outside. The summary takes each iteration's slowest rank, drops the first ``--warmup``
  iterations (default 1), and gives the mean and median over the rest.

Writes DIR/job_gloo.json (configuration, metadata, every rank's report, the summary) and the
ranks' logs under DIR/logs/. It does not take /run/gradwire-fabric.lock itself (a caller that
holds it would wait on itself): run it as ``flock /run/gradwire-fabric.lock python -m ...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

PERIOD = 23  # workload.rs PERIOD
MAX_SCALE = 100.0  # workload.rs MAX_SCALE
DEFAULT_MASTER_PORT = 29500  # worker.rs DEFAULT_MASTER_PORT
HOST_IF = "gw0"  # run.rs HOST_IF
BRIDGE = "br0"  # run.rs BRIDGE
PREFIX_LEN = 15  # run.rs RUN_PREFIX_LEN
MTU = 1500
MAX_HOSTS = 254
ITERATION_MARK = ": iteration "

# The netns kit's reaper (netns/src/reaper.rs Reaper::SCRIPT): "done" on stdin means we tore
# down ourselves; EOF (this process died, however) means delete every device but lo of each
# namespace, then its handle.
REAPER_SCRIPT = r"""IFS= read -r line || line=
[ "$line" = done ] && exit 0
for ns do
  ip -n "$ns" -o link show 2>/dev/null | while read -r _ dev _; do
    dev=${dev%:}; dev=${dev%%@*}
    [ "$dev" = lo ] || ip -n "$ns" link del "$dev" 2>/dev/null
  done
  ip netns del "$ns" 2>/dev/null
done
exit 0"""


class JobError(Exception):
    """A job file, model or run that cannot be used; the message says why."""


class Interrupted(Exception):
    """SIGTERM/SIGINT/SIGHUP: unwind through every cleanup."""


def _on_signal(signum, _frame):
    raise Interrupted(f"interrupted by signal {signum}")


# -- The job file and the model (as gradwire reads them) ---------------------------------------


def _load_structured(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise JobError(f"{path}: {e}") from e
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise JobError(f"{path}: {e}") from e


def in_bench_range(addr: str) -> bool:
    """run.rs ``in_bench_range``: inside 198.18.0.0/15, not its network or broadcast address."""
    try:
        o = [int(x) for x in addr.split(".")]
    except ValueError:
        return False
    if len(o) != 4 or not all(0 <= x <= 255 for x in o):
        return False
    inside = o[0] == 198 and (o[1] & 0xFE) == 18
    return inside and addr not in ("198.18.0.0", "198.19.255.255")


def load_job(path: Path) -> dict:
    """The job file's world, ranks' hosts, distinct hosts (in rank order of first
    appearance), each rank's host index and the master, checked as ``gradwire job run``
    checks them (run.rs ``plan``)."""
    doc = _load_structured(path)
    entries = doc.get("rank")
    if not isinstance(entries, list) or not entries:
        raise JobError(f"{path}: no [[rank]] entries")
    by_rank = {}
    for e in entries:
        r = e.get("rank")
        if not isinstance(r, int) or r in by_rank:
            raise JobError(f"{path}: rank {r!r} missing, not an integer, or given twice")
        by_rank[r] = e
    world = len(by_rank)
    if sorted(by_rank) != list(range(world)):
        raise JobError(f"{path}: ranks must be 0..{world - 1}, got {sorted(by_rank)}")
    rank_hosts = [str(by_rank[r].get("host", "")) for r in range(world)]
    hosts: list[str] = []
    host_of = []
    for r, h in enumerate(rank_hosts):
        if not in_bench_range(h):
            raise JobError(f"{path}: rank {r}'s host {h!r} is not an IPv4 address in 198.18.0.0/15")
        if h not in hosts:
            hosts.append(h)
        host_of.append(hosts.index(h))
    if len(hosts) > MAX_HOSTS:
        raise JobError(f"{path}: {len(hosts)} hosts, at most {MAX_HOSTS}")
    master = doc.get("master") or f"{rank_hosts[0]}:{DEFAULT_MASTER_PORT}"
    addr, _, port = str(master).rpartition(":")
    if addr != rank_hosts[0] or not port.isdigit():
        raise JobError(f"{path}: master {master!r} is not rank 0's host {rank_hosts[0]} with a port")
    return {"world": world, "job": doc.get("job"), "rank_hosts": rank_hosts, "hosts": hosts,
            "host_of": host_of, "master_addr": addr, "master_port": int(port)}  # fmt: skip


def _round_half_away(x: float) -> int:
    """Rust's f64::round for x >= 0 (half away from zero; Python's round() is half to even)."""
    f = math.floor(x)
    return f + 1 if x - f >= 0.5 else f


def model_layers(path: Path, scale: float) -> tuple[str, list[tuple[str, int]]]:
    """workload.rs ``model_layers``: the model's name and its layers (name, elements) at
    ``scale``, each at least one element."""
    if not (math.isfinite(scale) and 0.0 < scale <= MAX_SCALE):
        raise JobError(f"scale {scale} is not in (0, {MAX_SCALE}]")
    doc = _load_structured(path)
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise JobError(f"{path}: no layers")
    out = []
    for i, l in enumerate(layers):
        params = l.get("params")
        if not isinstance(params, int) or params <= 0:
            raise JobError(f"{path}: layers[{i}].params must be a positive integer")
        out.append((str(l.get("name", f"layer{i}")), max(1, _round_half_away(params * scale))))
    return str(doc.get("name", path.stem)), out


# -- The workload (workload.rs) -------------------------------------------------------------


def input_value(rank: int, layer: int, e: int) -> float:
    """workload.rs ``input``: rank ``rank``'s element ``e`` of layer ``layer``."""
    return float(((rank % PERIOD) * 7 + (layer % PERIOD) * 5 + (e % PERIOD) * 3) % PERIOD - 11)


def residue_sums(ranks, layer: int) -> list[float]:
    """workload.rs ``residue_sums``: per residue of the element index, the sum over ``ranks``."""
    ranks = list(ranks)
    return [float(sum(input_value(r, layer, k) for r in ranks)) for k in range(PERIOD)]


def periodic(values: list[float], n: int):
    """A float32 tensor of ``n`` elements whose element e is ``values[e % PERIOD]``."""
    import torch

    base = torch.tensor(values, dtype=torch.float32)
    return base.repeat(-(-n // PERIOD))[:n].contiguous()


# -- One rank -------------------------------------------------------------------------------


def run_worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    job = load_job(Path(a.job))
    if job["world"] != world:
        raise JobError(f"{a.job} has {job['world']} ranks, WORLD_SIZE is {world}")
    model, layers = model_layers(Path(a.model), a.scale)
    inputs = [periodic([input_value(rank, l, k) for k in range(PERIOD)], n) for l, (_, n) in enumerate(layers)]
    wants = [periodic(residue_sums(range(world), l), n) for l, (_, n) in enumerate(layers)]
    elements = sum(n for _, n in layers)

    t0 = time.perf_counter()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=a.timeout),
    )  # fmt: skip
    rendezvous_s = time.perf_counter() - t0
    iterations = []
    for it in range(1, a.iterations + 1):
        started = time.perf_counter()
        for l, (name, n) in enumerate(layers):
            t = inputs[l].clone()
            dist.all_reduce(t)  # sum, Gloo's default algorithm
            if not torch.equal(t, wants[l]):
                bad = (t != wants[l]).nonzero()
                e = int(bad[0]) if len(bad) else -1
                got = float(t[e]) if e >= 0 else float("nan")
                want = float(wants[l][e]) if e >= 0 else float("nan")
                raise JobError(
                    f"WRONG RESULT: rank {rank}, iteration {it}, layer {l} ({name}), element {e}: "
                    f"got {got}, want {want} (the exact sum over ranks 0..{world})"
                )
        ms = (time.perf_counter() - started) * 1e3
        iterations.append({"iteration": it, "ms": ms})
        print(f"rank {rank}{ITERATION_MARK}{it}/{a.iterations}: {ms:.1f} ms", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    report = {
        "rank": rank, "world": world, "launcher": "torchrun", "host": job["rank_hosts"][rank],
        "master": f"{master_addr}:{master_port}", "algorithm": "gloo", "op": "sum", "loss_bound": 0.0,
        "model": model, "scale": a.scale, "iterations": iterations, "layers": len(layers),
        "elements": elements, "verified": True, "rendezvous_s": rendezvous_s,
    }  # fmt: skip
    print(json.dumps(report), flush=True)
    return 0


# -- The namespaces (run.rs build_namespaces, with ip) ---------------------------------------


def host_mac(i: int) -> str:
    """netns/src/testbed.rs ``host_mac``."""
    n = min(i + 1, 0xFFFF)
    return f"02:67:77:00:{n >> 8:02x}:{n & 0xFF:02x}"


def _ip(args: list[str], stdin: str | None = None) -> None:
    r = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise JobError(f"ip {' '.join(args)}: {r.stderr.strip()}")


_GROUP = 0


class Namespaces:
    """One namespace per host with ``gw0`` on a bridge in a switch namespace; ``down()``
    removes them (every device but lo, then the handle), and a reaper does if this process
    dies first."""

    def __init__(self, hosts: list[str]) -> None:
        global _GROUP
        prefix = f"gw{os.getpid()}t{900 + _GROUP}"  # the kit's temporary names; t900+ is ours
        _GROUP += 1
        self.hosts = hosts
        self.host_ns = [f"{prefix}h{i}" for i in range(len(hosts))]
        self.sw = f"{prefix}sw"
        self.all = [*self.host_ns, self.sw]
        self.created: list[str] = []
        self.reaper: subprocess.Popen | None = None

    def up(self) -> "Namespaces":
        if os.geteuid() != 0:
            raise JobError("needs root: it creates network namespaces")
        self.reaper = subprocess.Popen(
            ["/bin/sh", "-c", REAPER_SCRIPT, "gradwire-netns-reaper", *self.all], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0,
        )  # fmt: skip
        for ns in self.all:
            _ip(["netns", "add", ns])
            self.created.append(ns)
            # IPv6 off before any interface exists (new ones inherit `default`), lo up.
            subprocess.run(
                ["ip", "netns", "exec", ns, "sh", "-c",
                 "for c in default all; do echo 1 > /proc/sys/net/ipv6/conf/$c/disable_ipv6; done 2>/dev/null; true"],
                check=True, timeout=60,
            )  # fmt: skip
            _ip(["-n", ns, "link", "set", "lo", "up"])
        _ip(["-n", self.sw, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0",
             "mcast_snooping", "0"])  # fmt: skip
        ports = []
        for i, ns in enumerate(self.host_ns):
            port = f"h{i}"
            _ip(["-n", ns, "link", "add", HOST_IF, "mtu", str(MTU), "address", host_mac(i), "type", "veth",
                 "peer", "name", port, "mtu", str(MTU), "netns", self.sw])  # fmt: skip
            ports += [f"link set {port} master {BRIDGE}", f"link set {port} up"]
        ports.append(f"link set {BRIDGE} up")
        _ip(["-n", self.sw, "-batch", "-"], "\n".join(ports) + "\n")
        for i, ns in enumerate(self.host_ns):
            lines = [f"addr add {self.hosts[i]}/{PREFIX_LEN} dev {HOST_IF}", f"link set {HOST_IF} up"]
            lines += [f"neigh replace {h} lladdr {host_mac(j)} dev {HOST_IF} nud permanent"
                      for j, h in enumerate(self.hosts) if j != i]  # fmt: skip
            _ip(["-n", ns, "-batch", "-"], "\n".join(lines) + "\n")
        return self

    def down(self) -> list[str]:
        """Removes every namespace created (last first); returns the problems."""
        problems = []
        for ns in reversed(self.created):
            r = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True, text=True, timeout=60)
            for line in r.stdout.splitlines():
                dev = line.split()[1].rstrip(":").split("@")[0]
                if dev != "lo":
                    d = subprocess.run(["ip", "-n", ns, "link", "del", dev], capture_output=True, text=True,
                                       timeout=60)  # fmt: skip
                    # A veth's peer goes with it: "Cannot find device" is not a problem.
                    if d.returncode != 0 and "Cannot find" not in d.stderr:
                        problems.append(f"ip -n {ns} link del {dev}: {d.stderr.strip()}")
            d = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=60)
            if d.returncode != 0:
                problems.append(f"ip netns del {ns}: {d.stderr.strip()}")
        self.created.clear()
        if self.reaper is not None:
            try:
                assert self.reaper.stdin is not None
                self.reaper.stdin.write(b"done\n")
                self.reaper.stdin.close()
            except OSError:
                pass
            try:
                self.reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
            self.reaper = None
        return problems


# -- The run ----------------------------------------------------------------------------------


def summarize(reports: list[dict], warmup: int = 1) -> dict:
    """Per iteration the slowest rank's time; mean, median, min and max over the iterations
    after the first ``warmup`` (none dropped when that would leave nothing). Works on
    ``gradwire job run --json``'s reports too."""
    n = min(len(r["iterations"]) for r in reports)
    per_it = [max(r["iterations"][i]["ms"] for r in reports) for i in range(n)]
    drop = warmup if n > warmup else 0
    timed = per_it[drop:]
    rank_ms = [r["iterations"][i]["ms"] for r in reports for i in range(drop, n)]
    return {
        "iterations": n,
        "warmup_dropped": drop,
        "per_iteration_ms": per_it,
        "mean_ms": statistics.fmean(timed),
        "median_ms": statistics.median(timed),
        "min_ms": min(timed),
        "max_ms": max(timed),
        "rank_mean_ms": statistics.fmean(rank_ms),
        "verified": all(r.get("verified") is True for r in reports) and len(reports) == reports[0]["world"],
    }


def _kill_all(procs: list[subprocess.Popen]) -> None:
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


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text()[-n:].strip().replace("\n", " | ")
    except OSError:
        return ""


def run_job(a: argparse.Namespace, out: Path) -> dict:
    """Namespaces up, every rank run and supervised, namespaces down; the ranks' reports."""
    from gradwire.experiments.convergence import die_with_parent

    job = load_job(Path(a.job))
    model, layers = model_layers(Path(a.model), a.scale)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    worker_args = ["--job", str(Path(a.job).resolve()), "--model", str(Path(a.model).resolve()), "--scale",
                   repr(a.scale), "--iterations", str(a.iterations), "--timeout", repr(a.timeout)]  # fmt: skip
    nets = Namespaces(job["hosts"])
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        nets.up()
        local: dict[int, int] = {}
        for r, h in enumerate(job["host_of"]):
            lr = local.get(h, 0)
            local[h] = lr + 1
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(job["world"]), LOCAL_RANK=str(lr),
                       MASTER_ADDR=job["master_addr"], MASTER_PORT=str(job["master_port"]),
                       GLOO_SOCKET_IFNAME=HOST_IF, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
            cmd = ["ip", "netns", "exec", nets.host_ns[h], sys.executable, "-m", "gradwire.experiments.job_gloo",
                   "--worker", *worker_args]  # fmt: skip
            with open(logs / f"rank{r}.json", "w") as o, open(logs / f"rank{r}.log", "w") as e:
                procs.append(subprocess.Popen(cmd, env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                              start_new_session=True, preexec_fn=die_with_parent()))  # fmt: skip
        deadline = started + a.deadline
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _kill_all(procs)
                why = "; ".join(f"rank {r} exited {codes[r]}: {_tail(logs / f'rank{r}.log')}" for r in failed)
                raise JobError(f"rank(s) {failed} failed, the others were stopped: {why}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                _kill_all(procs)
                raise JobError(f"deadline of {a.deadline} s passed; ranks {running} still running")
            time.sleep(0.05)
    finally:
        _kill_all(procs)
        problems = nets.down()
        if problems:
            print("job_gloo: teardown: " + "; ".join(problems), file=sys.stderr)
    reports = []
    for r in range(job["world"]):
        text = (logs / f"rank{r}.json").read_text()
        try:
            reports.append(json.loads(text))
        except ValueError as e:
            raise JobError(f"rank {r} wrote no report ({e}): {text[-500:]!r}") from e
    return {"job": job, "model": model, "layers": layers, "reports": reports,
            "wall_s": time.monotonic() - started, "namespaces": nets.all,
            "worker_pids": [p.pid for p in procs]}  # fmt: skip


def metadata(argv: list[str]) -> dict:
    import torch

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m gradwire.experiments.job_gloo " + " ".join(argv),
        "commit": git("rev-parse", "HEAD"), "kernel": platform.release(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
        "backend": "torch.distributed gloo, defaults (init_method tcp://master, all_reduce SUM)",
        "env": {"GLOO_SOCKET_IFNAME": HOST_IF, "OMP_NUM_THREADS": "1"},
        "timing": "per rank the wall time of each iteration (fill, all-reduce of every layer, exact check); "
                  "per iteration the slowest rank; the first iteration(s) dropped as warm-up",
    }  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradwire.experiments.job_gloo", description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True, help="job file (TOML or JSON), as `gradwire job run FILE`")
    p.add_argument("--iterations", type=int, default=5, help="iterations (one all-reduce of every layer each)")
    p.add_argument("--model", default="control/models/resnet50.toml", help="model layer file")
    p.add_argument("--scale", type=float, default=0.01, help="tensor size scale (1 = the model's real sizes)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="Gloo's timeout (rendezvous and each operation), seconds")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds the whole run may take")
    p.add_argument("--warmup", type=int, default=1, help="iterations the summary drops")
    p.add_argument("--out", help="directory for job_gloo.json and logs/")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.iterations < 1:
        p.error("--iterations must be at least 1")
    if not a.worker and not a.out:
        p.error("--out is required")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.worker:
        try:
            return run_worker(a)
        except JobError as e:
            print(f"job_gloo worker: {e}", file=sys.stderr)
            return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = metadata(argv)
    try:
        run = run_job(a, out)
    except (JobError, Interrupted) as e:
        print(f"job_gloo: {e}", file=sys.stderr)
        return 1
    summary = summarize(run["reports"], a.warmup)
    doc: dict[str, Any] = {
        "config": {"job": a.job, "model": a.model, "scale": a.scale, "iterations": a.iterations,
                   "layers": len(run["layers"]), "elements": sum(n for _, n in run["layers"]),
                   "world": run["job"]["world"], "hosts": run["job"]["hosts"], "warmup": a.warmup,
                   "timeout": a.timeout},  # fmt: skip
        "metadata": meta,
        "wall_s": run["wall_s"],
        "namespaces": run["namespaces"],
        "worker_pids": run["worker_pids"],
        "summary": summary,
        "reports": run["reports"],
    }
    (out / "job_gloo.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"gloo: {run['job']['world']} ranks, {len(run['layers'])} layers ({doc['config']['elements']} f32), "
        f"{a.iterations} iterations, every result exact: per iteration (slowest rank, first "
        f"{summary['warmup_dropped']} dropped) mean {summary['mean_ms']:.1f} ms, median {summary['median_ms']:.1f} ms"
    )
    return 0 if summary["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
