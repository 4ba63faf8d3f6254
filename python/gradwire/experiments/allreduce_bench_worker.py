"""One rank of the all-reduce benchmark, started by ``gradwire.experiments.allreduce_bench``
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    python -m gradwire.experiments.allreduce_bench_worker --config CFG.json --out ROWS.jsonl

Every rank runs the same cases in the same order: for each repeat, size and variant (Gloo,
or gradwire with an algorithm and a loss bound), one case is

1. warm-up operations (checked, not timed);
2. the **timed loop**: each iteration refills the buffer, aligns the ranks with a Gloo
   all-reduce of a one-element flag (the barrier, which also tells every rank whether a
   gradwire session broke), times one all-reduce, and checks its result. The row's time of an
   iteration is the slowest rank's (nccl-tests' convention), p50 and p99 over iterations;
3. the **counted loop**: operations back to back (as many as fill ``counted_target_s`` at the
   timed p50), bracketed by barriers, with rank 0 reading the machine's busy CPU time
   (/proc/stat) and the frames on the wire (loopback: ``lo`` in /proc/net/dev; fabric: the
   switch's received frames from ``gradwire fabric stats``) before and after. Results grow in
   place (the sum of identical buffers is ``world`` times the buffer), so every rank checks
   and refills after at most ``chunk`` operations, while the values are still exact integers,
   or at once after an operation that scaled a block (below); the CPU time of that checking
   (each rank's thread time) is taken off the window's CPU time (its two barriers, each about
   one small operation's cost, are left in: at most 2/``ops`` of an operation's), their frames
   off its frames. For gradwire the row also carries ``msg_counters``, the message layer's
   counters over the whole case summed over the ranks (resends, POLL timers, NACKs,
   refusals), and ``msg_ops``, the operations they cover. The row also says how much of the
   machine other programs took during the case (``other_cpu_share``); before each size the ranks wait, up to
   ``quiet_wait_s``, for that share to drop to ``max_other_cpu``.

Rank r contributes ``(r + 1) * (i % 7 + 1)`` at element i: float32 sums of these integers are
exact in any order, so p = 0 and Gloo must give exactly ``world * (world + 1) / 2 * (i % 7 +
1)``. With a loss bound a block may miss contributors: the report's ``block_contributors``
name them, and ``op="sum"`` then makes the block the contributors' sum times
``float32(world) / float32(len(contributors))`` (their average times the world, gradwire's
unbiased estimate of the sum, ``collective/src/aggregate.rs``), which the check computes with
the same float32 operations and compares exactly. A digest of the contributor sets of
every operation and a hash of the final buffer are all-gathered at the end of the case: the
ranks must agree. Rank 0 appends one JSON row per case to ``--out`` (a first line with the
run's metadata); a case that broke a session is a row with its error, and the session is
built again for the next case.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import gradwire
from gradwire.ddp import local_ip_towards

# Names tried when the session takes ``algorithm=`` but names no algorithms of its own.
ALGORITHM_CANDIDATES = ("ring", "direct", "tree")
# Names that pick one of the others (the session's "auto": two-phase for small worlds or
# tensors, ring otherwise): not run unless --algorithms names them.
DISPATCHERS = ("auto",)
# float32 holds every integer up to 2**24 exactly.
EXACT_LIMIT = float(1 << 24)


# -- counters (read by rank 0) -----------------------------------------------------------------


def busy_jiffies() -> tuple[int, int]:
    """The whole machine's (user + nice + system + irq + softirq, user + nice) from
    /proc/stat, in ticks."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6], v[0] + v[1]


def user_jiffies(pids: list[int]) -> int:
    """User ticks of the processes `pids` (all their threads). User time only: the kernel
    charges a process with softirq work it happens to interrupt, which /proc/stat counts as
    softirq, so system times do not add up between the two."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            total += int(f.read().rsplit(")", 1)[1].split()[11])
    return total


def lo_packets() -> int:
    """Packets sent on ``lo`` (each one is also received once on it)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[9])
    raise RuntimeError("no lo in /proc/net/dev")


@dataclass
class Snapshot:
    t: float  # time.monotonic() when the CPU counters were read
    jiffies: tuple[int, int]  # busy_jiffies()
    ours_jiffies: int  # user_jiffies() of the ranks and the fabric
    frames: int
    fabric: dict[str, float] = field(default_factory=dict)


class Counters:
    """Rank 0's view of the machine and the wire; the other ranks only sleep when rank 0 lets
    the fabric's stats file catch up (it is rewritten every 200 ms)."""

    def __init__(self, cfg: dict, rank: int, pids: list[int]) -> None:
        self.rank, self.pids = rank, pids
        self.fabric = cfg.get("fabric")
        self.settle_s = float(cfg.get("settle_s", 0.5)) if self.fabric else 0.0

    def _fabric(self) -> dict[str, float]:
        r = subprocess.run(
            [self.fabric["binary"], "fabric", "stats", self.fabric["name"], "--json"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"gradwire fabric stats failed: {r.stderr.strip()}")
        s = json.loads(r.stdout)
        out = {"rx": 0.0, "lost": 0.0, "delivered": 0.0, "dropped": 0.0,
               "departures": float(s["lag"]["departures"]), "late": float(s["lag"]["late"]),
               "loop_cpu_s": float(s["loop_cpu_s"])}  # fmt: skip
        for sw in s["switches"]:
            out["rx"] += sw["forward"]["rx"]
            for port in sw["ports"]:
                eg = port["egress"]
                out["lost"] += eg["lost_pkts"]
                out["delivered"] += eg["delivered_pkts"]
                out["dropped"] += sum(q["dropped_threshold"] + q["dropped_buffer"] for q in eg["queues"])
        return out

    def snapshot(self, end: bool) -> Snapshot | None:
        """Every rank calls it after a barrier (traffic stopped). The machine's CPU time is
        read next to the window it bounds (``end``: first, before the wait for the fabric's
        stats; else last), so neither the wait nor the stats command falls into it."""
        if self.rank != 0:
            if self.settle_s:
                time.sleep(self.settle_s)
            return None
        cpu = self.cpu() if end else None
        if self.fabric:
            time.sleep(self.settle_s)
            fab = self._fabric()
            return Snapshot(*(cpu or self.cpu()), int(fab["rx"]), fab)
        return Snapshot(*(cpu or self.cpu()), lo_packets())

    def cpu(self) -> tuple[float, tuple[int, int], int]:
        """(monotonic time, busy_jiffies(), user_jiffies() of the ranks and the fabric)."""
        return time.monotonic(), busy_jiffies(), user_jiffies(self.pids)


def quiet_gate(counters: Counters, cfg: dict) -> float:
    """Before a size: rank 0 waits, at most ``quiet_wait_s``, until programs other than the
    ranks took at most ``max_other_cpu`` of the machine over a 0.3 s sample (another
    engineer's build on the same 2 cores would be timed with us). Every rank waits with it;
    returns rank 0's wait in seconds."""
    waited = 0.0
    if counters.rank == 0 and cfg["quiet_wait_s"] > 0:
        t0 = time.monotonic()
        hz, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        while time.monotonic() - t0 < cfg["quiet_wait_s"]:
            ta, (_, ua), ra = counters.cpu()
            time.sleep(0.3)
            tb, (_, ub), rb = counters.cpu()
            if ((ub - ua) - (rb - ra)) / hz <= cfg["max_other_cpu"] * (tb - ta) * cores:
                break
        waited = time.monotonic() - t0
    return float(gather(waited)[0])


def delta(a: Snapshot, b: Snapshot) -> dict[str, float]:
    """From `a` to `b`: the machine's busy CPU seconds, the frames, and ``other_cpu_s``, the
    user time of everything but the ranks and the fabric (another program's work on the same
    cores, e.g. a build)."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {"wall_s": b.t - a.t, "cpu_s": (b.jiffies[0] - a.jiffies[0]) / hz, "frames": float(b.frames - a.frames)}
    for k in a.fabric:
        out["fabric_" + k] = b.fabric[k] - a.fabric[k]
    out["other_cpu_s"] = ((b.jiffies[1] - a.jiffies[1]) - (b.ours_jiffies - a.ours_jiffies)) / hz
    return out


# -- gradwire sessions -------------------------------------------------------------------------


def algorithm_option() -> str | None:
    """Where the session takes ``algorithm=``: "op" (``all_reduce``), "session" (``init``),
    or None (the session has one algorithm)."""
    for where, fn in (("op", gradwire.Session.all_reduce), ("session", gradwire.Session.init)):
        try:
            if "algorithm" in inspect.signature(fn).parameters:
                return where
        except (TypeError, ValueError):
            continue
    return None


def listed_algorithms() -> list[str] | None:
    """The algorithms the native module lists, if it lists any."""
    for owner, name in ((gradwire._native, "ALGORITHMS"), (gradwire.Session, "algorithms")):
        found = getattr(owner, name, None)
        if isinstance(found, (list, tuple)) and all(isinstance(a, str) for a in found):
            return list(found)
    return None


def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Sessions:
    """This rank's gradwire sessions: one, or one per algorithm when the algorithm is chosen
    at set-up. Built collectively; a broken one is dropped and built again."""

    def __init__(self, cfg: dict, rank: int, world: int, ip: str) -> None:
        self.cfg, self.rank, self.world, self.ip = cfg, rank, world, ip
        self.where = algorithm_option()
        self.by_key: dict[str | None, gradwire.Session] = {}
        self.jobs = 0

    def _init(self, algorithm: str | None) -> gradwire.Session:
        self.jobs += 1
        kw: dict[str, Any] = {"timeout": self.cfg["timeout_s"], "rate_bps": self.cfg.get("rate_bps")}
        if algorithm is not None and self.where == "session":
            kw["algorithm"] = algorithm
        return gradwire.Session.init(gather, self.rank, self.world, self.ip, job=self.jobs, **kw)

    def key(self, algorithm: str | None) -> str | None:
        return algorithm if self.where == "session" else None

    def get(self, algorithm: str | None) -> gradwire.Session:
        k = self.key(algorithm)
        if k not in self.by_key:
            self.by_key[k] = self._init(algorithm)
        return self.by_key[k]

    def drop(self, algorithm: str | None) -> None:
        """Closes the session `algorithm` runs on (after an error: its peers, still waiting in
        the operation, see it gone instead of a live peer that sends nothing)."""
        old = self.by_key.pop(self.key(algorithm), None)
        if old is not None:
            old.close()

    def named(self) -> list[str]:
        """The algorithms the session names when it refuses an unknown one (``algorithm=``
        of ``all_reduce`` only: a session is not built to be refused)."""
        if self.where != "op":
            return []
        try:
            self.get(None).all_reduce(np.ones(1, np.float32), algorithm="?")
        except ValueError as e:
            return re.findall(r"'([A-Za-z0-9_-]+)'", str(e))
        return []

    def probe(self, candidates: list[str]) -> list[str]:
        """The candidates every rank's session accepts. A refusal is raised before anything
        is sent, so every rank refuses the same names; it is a ValueError (today a plain one
        for ``algorithm=``, not gradwire.ConfigError, which is one too)."""
        accepted = []
        for a in candidates:
            try:
                if self.where == "session":
                    self.get(a)
                else:
                    self.get(None).all_reduce(np.ones(1, np.float32), algorithm=a)
                ok = True
            except ValueError:
                ok = False
            if all(gather(ok)):
                accepted.append(a)
        return accepted

    def close(self) -> None:
        for s in self.by_key.values():
            s.close()


def variants(cfg: dict, sessions: Sessions) -> tuple[list[dict], dict]:
    """The run's variants, and what was found out about the algorithms."""
    out: list[dict] = []
    if "gloo" in cfg["impls"]:
        out.append({"name": "gloo", "impl": "gloo", "algorithm": None, "loss_bound": None})
    info: dict[str, Any] = {"algorithm_option": sessions.where}
    if cfg.get("algorithms") and sessions.where is None:
        info["ignored"] = f"--algorithms {','.join(cfg['algorithms'])}: the session takes no algorithm="
    if "gradwire" in cfg["impls"]:
        algorithms: list[str | None] = [None]
        if sessions.where is not None:
            candidates = cfg.get("algorithms") or [
                a for a in (listed_algorithms() or sessions.named() or ALGORITHM_CANDIDATES) if a not in DISPATCHERS
            ]
            accepted = sessions.probe(candidates)
            info.update(candidates=candidates, accepted=accepted)
            algorithms = list(accepted) or [None]
        for a in algorithms:
            for p in cfg["loss_bounds"]:
                name = "gradwire" + (f"-{a}" if a else "") + f"-p{100 * p:g}"
                out.append({"name": name, "impl": "gradwire", "algorithm": a, "loss_bound": p})
    return out, info


# -- one case ----------------------------------------------------------------------------------


class Pattern:
    """A size's buffers: the pattern ``i % 7 + 1``, this rank's contribution ``(rank + 1)``
    times it, and the buffer reduced in place."""

    def __init__(self, elems: int, rank: int) -> None:
        self.base = (np.arange(elems) % 7 + 1).astype(np.float32)
        self.mine = self.base * np.float32(rank + 1)
        self.buf = np.empty(elems, np.float32)
        self.tensor = torch.from_numpy(self.buf)  # the same memory, for Gloo


def chunk_length(world: int) -> int:
    """In-place operations in a row whose results stay exact: 7 * weight * world**(k-1) <= 2**24."""
    k, v = 1, 7.0 * world * (world + 1) / 2
    while v * world <= EXACT_LIMIT:
        k, v = k + 1, v * world
    return k


@dataclass
class Check:
    """What a rank found in its results over a case."""

    ops: int = 0
    failed_ops: int = 0
    first_failure: str | None = None
    partial_blocks: int = 0
    delivered_min: float = 1.0
    digest: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))

    def fail(self, why: str) -> None:
        self.failed_ops += 1
        if self.first_failure is None:
            self.first_failure = f"op {self.ops}: {why}"


@dataclass
class Step:
    """What one operation did to each block, from its report: it multiplied the values by an
    integer ``factor`` (the first operation on the pattern: the sum of the contributors'
    ``r + 1``; a later one: how many contributed, every rank then holding the same values),
    and where contributors were missing, ``op="sum"`` scaled the block by
    ``float32(world) / float32(count)`` (gradwire's unbiased estimate of the sum: the
    contributors' average times the world). One factor and no scale when every block is
    complete (Gloo, which has no report, always is)."""

    factor: np.ndarray  # float64 integers, one per block or one for all
    scale: np.ndarray | None  # float32 per block, None when nothing was scaled
    block: int
    partial: int

    @staticmethod
    def of(report: Any, world: int, first: bool, elems: int) -> "Step":
        block = max(elems, 1) if report is None else report.block_elems
        if report is None or report.complete_blocks == report.blocks:
            return Step(np.array([world * (world + 1) / 2 if first else world]), None, block, 0)
        sets = report.block_contributors
        factor = np.array([sum(r + 1 for r in c) if first else len(c) for c in sets], np.float64)
        w = np.float32(world)
        scale = np.array([1 if len(c) >= world else w / np.float32(max(len(c), 1)) for c in sets], np.float32)
        return Step(factor, scale, block, report.blocks - report.complete_blocks)


def per_element(x: np.ndarray, block: int, n: int) -> np.ndarray:
    """Per-block values as float32 per element (one value: as it is, numpy broadcasts it)."""
    return np.repeat(x.astype(np.float32), block)[:n] if x.size > 1 else x.astype(np.float32)


def expected(pat: Pattern, factor: np.ndarray, last: Step) -> np.ndarray:
    """The pattern times ``factor`` (exact integers), then scaled as ``last`` scaled it."""
    n = pat.base.size
    v = pat.base * per_element(factor, last.block, n)
    if last.scale is not None:
        v *= per_element(last.scale, last.block, n)
    return v


def note(chk: Check, report: Any, step: Step) -> None:
    """Counts one operation's contributor sets into the check (digest, partial blocks)."""
    chk.ops += 1
    chk.digest.update(step.factor.tobytes())
    if step.scale is not None:
        chk.digest.update(step.scale.tobytes())
    chk.partial_blocks += step.partial
    if report is not None:
        chk.delivered_min = min(chk.delivered_min, report.delivered_fraction)


def run_op(v: dict, pat: Pattern, sessions: Sessions) -> Any:
    """One all-reduce of the pattern's buffer in place; gradwire's report (Gloo: None)."""
    if v["impl"] == "gloo":
        dist.all_reduce(pat.tensor)
        return None
    kw: dict[str, Any] = {"op": "sum", "loss_bound": v["loss_bound"]}
    if v["algorithm"] is not None and sessions.where == "op":
        kw["algorithm"] = v["algorithm"]
    return sessions.get(v["algorithm"]).all_reduce(pat.buf, **kw)


def sync(broken: bool) -> bool:
    """The barrier: a Gloo all-reduce of one flag. True when any rank's session broke."""
    flag = torch.tensor([1 if broken else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def checked_op(v: dict, pat: Pattern, sessions: Sessions, chk: Check, world: int) -> tuple[int, str | None]:
    """One timed all-reduce of the refilled buffer, checked: (ns, error)."""
    try:
        t0 = time.perf_counter_ns()
        report = run_op(v, pat, sessions)
        ns = time.perf_counter_ns() - t0
    except gradwire.GradwireError as e:
        sessions.drop(v["algorithm"])
        return -1, f"{type(e).__name__}: {e}"
    step = Step.of(report, world, True, pat.base.size)
    note(chk, report, step)
    if not np.array_equal(pat.buf, expected(pat, step.factor, step)):
        chk.fail("values differ from the sum over the contributors")
    return ns, None


def timed_loop(v: dict, pat: Pattern, sessions: Sessions, chk: Check, world: int,
               total: int) -> tuple[list[int], str | None]:
    """``total`` aligned operations: (this rank's ns per operation, error). Every rank runs
    the same number of barriers, so a rank whose session broke stops them all at the next."""
    times: list[int] = []
    error = None
    while True:
        if error is None and len(times) < total:
            np.copyto(pat.buf, pat.mine)
        if sync(error is not None):
            return times, error or "a session broke on another rank"
        if len(times) == total:
            return times, None
        ns, error = checked_op(v, pat, sessions, chk, world)
        if error is None:
            times.append(ns)


def counted_loop(v: dict, pat: Pattern, sessions: Sessions, chk: Check, world: int, ops: int,
                 counters: Counters) -> tuple[dict | None, float, Snapshot | None, str | None]:
    """``ops`` operations back to back: (rank 0's counter deltas over them, this rank's
    checking CPU seconds, rank 0's snapshot at the end, error)."""
    chunk = chunk_length(world)
    np.copyto(pat.buf, pat.mine)
    sync(False)
    a = counters.snapshot(end=False)
    sync(False)
    overhead, error = 0.0, None
    factor: np.ndarray | None = None  # since the last refill; None: the buffer is the pattern
    since = 0
    for j in range(ops):
        try:
            report = run_op(v, pat, sessions)
        except gradwire.GradwireError as e:
            sessions.drop(v["algorithm"])
            error = f"{type(e).__name__}: {e}"
            break
        t0 = time.thread_time()
        step = Step.of(report, world, factor is None, pat.base.size)
        note(chk, report, step)
        factor = step.factor if factor is None else factor * step.factor
        since += 1
        # Values stay exact integers until a block is scaled or `chunk` operations have grown
        # them: then check, and start again from the pattern.
        if step.scale is not None or since == chunk or j + 1 == ops:
            if not np.array_equal(pat.buf, expected(pat, factor, step)):
                chk.fail("values differ from the sums over the contributors (counted loop)")
            if j + 1 < ops:  # the last result stays, for the hash
                np.copyto(pat.buf, pat.mine)
                factor, since = None, 0
        overhead += time.thread_time() - t0
    if sync(error is not None):
        error = error or "a session broke on another rank"
    b = counters.snapshot(end=True)
    return (delta(a, b) if a and b else None), overhead, b, error


def pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def message_stats(v: dict, sessions: Sessions) -> dict | None:
    """gradwire's message-layer counters on this rank (None for Gloo or off the layer)."""
    if v["impl"] != "gradwire":
        return None
    try:
        return sessions.get(v["algorithm"]).message_stats()
    except (gradwire.GradwireError, AttributeError):  # a broken session; an older package
        return None


def run_case(v: dict, size: int, iters: int, warmup: int, pat: Pattern, sessions: Sessions,
             counters: Counters, barrier: dict | None, cfg: dict) -> dict | None:
    """One case on every rank; the row on rank 0 (None elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chk = Check()
    start = counters.snapshot(end=False)
    msg0 = message_stats(v, sessions)
    times, error = timed_loop(v, pat, sessions, chk, world, warmup + iters)
    all_times = [t[warmup:] for t in gather(times)]
    per_iter = sorted(max(t[i] for t in all_times) / 1e3 for i in range(min(map(len, all_times))))
    counted, overhead, end, ops = None, 0.0, None, 0
    if error is None and per_iter:
        ops = min(cfg["counted_max_ops"], max(2, math.ceil(cfg["counted_target_s"] * 1e6 / pct(per_iter, 0.5))))
        counted, overhead, end, error = counted_loop(v, pat, sessions, chk, world, ops, counters)
    else:
        end = counters.snapshot(end=True)
    msg1 = message_stats(v, sessions)
    msg = {k: msg1[k] - msg0.get(k, 0) for k in msg1} if msg0 is not None and msg1 is not None else None
    mine = {"msg": msg, "error": error, "failed_ops": chk.failed_ops, "first_failure": chk.first_failure,
            "ops": chk.ops, "digest": chk.digest.hexdigest(), "overhead_s": overhead,
            "hash": hashlib.blake2b(pat.buf.data, digest_size=16).hexdigest(),
            "partial_blocks": chk.partial_blocks, "delivered_min": chk.delivered_min}  # fmt: skip
    ranks = gather(mine)
    if v["impl"] == "gradwire" and any(r["error"] for r in ranks):
        sessions.drop(v["algorithm"])  # on every rank: build it again, together
        sessions.get(v["algorithm"])
    if rank != 0:
        return None
    whole = delta(start, end) if start and end else None
    return make_row(v, size, iters, warmup, ops, per_iter, all_times[0], ranks, counted, barrier, whole)


def make_row(v: dict, size: int, iters: int, warmup: int, ops: int, per_iter: list[float], rank0_ns: list[int],
             ranks: list[dict], counted: dict | None, barrier: dict | None, whole: dict | None) -> dict:
    world = len(ranks)
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if r["error"]]
    wrong = [f"rank {i}: {r['failed_ops']} of {r['ops']} results wrong ({r['first_failure']})"
             for i, r in enumerate(ranks) if r["failed_ops"]]
    same_sets, same_values = len({r["digest"] for r in ranks}) == 1, len({r["hash"] for r in ranks}) == 1
    problems = errors + wrong
    if not same_sets:
        problems.append("the ranks' reports disagree on the blocks' contributors")
    if not same_values:
        problems.append("the ranks' final buffers differ")
    failure = "; ".join(problems) or None
    row: dict[str, Any] = {
        "variant": v["name"], "impl": v["impl"], "algorithm": v["algorithm"], "loss_bound": v["loss_bound"],
        "ranks": world, "size_bytes": size, "elems": size // 4, "iters": iters, "warmup": warmup,
        "counted_ops": ops, "checked": not errors, "correct": failure is None, "failure": failure,
        "results_identical": same_sets and same_values, "result_hash": ranks[0]["hash"],
        "ops_checked": [r["ops"] for r in ranks],
        "partial_blocks": sum(r["partial_blocks"] for r in ranks),
        "delivered_min": min(r["delivered_min"] for r in ranks) if v["impl"] == "gradwire" else None,
    }  # fmt: skip
    msgs = [r["msg"] for r in ranks if r.get("msg")]
    if len(msgs) == world:
        # The message layer's counters over the whole case (warm-up, timed and counted
        # operations), summed over the ranks: resends, POLL timers and NACKs say why a case
        # was slow without a packet capture.
        row["msg_counters"] = {k: sum(m[k] for m in msgs) for k in msgs[0]}
        row["msg_ops"] = warmup + iters + ops
    if whole:
        # How much of the machine other programs took during the case (a shared machine's
        # timings are not this code's).
        row["other_cpu_share"] = whole["other_cpu_s"] / (whole["wall_s"] * (os.cpu_count() or 1))
    if whole and "fabric_departures" in whole:
        dep, late = whole["fabric_departures"], whole["fabric_late"]
        row["fabric"] = {k[len("fabric_"):]: x for k, x in whole.items() if k.startswith("fabric_")}
        row["valid"] = not (dep > 0 and late > 0.01 * dep)  # the fabric's own `behind` rule
    else:
        row["valid"] = True
    if failure is not None or not per_iter or not counted:
        return row  # a failed case has no times
    p50, p99 = pct(per_iter, 0.5), pct(per_iter, 0.99)
    algbw = size / (p50 / 1e6) / 1e9
    b_frames = 2 * barrier["frames"] if barrier else 0.0
    checking = sum(r["overhead_s"] for r in ranks)
    row.update(
        time_p50_us=p50, time_p99_us=p99, time_mean_us=sum(per_iter) / len(per_iter),
        rank0_p50_us=pct(sorted(t / 1e3 for t in rank0_ns), 0.5),
        algbw_GBps=algbw, busbw_GBps=algbw * 2 * (world - 1) / world,
        frames_per_op=max(counted["frames"] - b_frames, 0.0) / ops,
        cpu_s_per_op=max(counted["cpu_s"] - checking, 0.0) / ops,
        window={"cpu_s": counted["cpu_s"], "frames": counted["frames"], "checking_cpu_s": checking,
                "barriers_frames": b_frames, "other_cpu_s": counted["other_cpu_s"]},
    )  # fmt: skip
    return row


def barrier_cost(counters: Counters, n: int = 40) -> dict | None:
    """CPU seconds and frames of one barrier (rank 0; None elsewhere)."""
    sync(False)
    a = counters.snapshot(end=False)
    for _ in range(n):
        sync(False)
    b = counters.snapshot(end=True)
    if not a or not b:
        return None
    d = delta(a, b)
    return {"cpu_s": d["cpu_s"] / n, "frames": d["frames"] / n}


def schedule(cfg: dict) -> list[tuple[int, int, int, int]]:
    """(repeat, size, iters, warmup) in run order."""
    return [(rep, s, cfg["iters"][str(s)], cfg["warmup"][str(s)]) for rep in range(cfg["repeats"])
            for s in cfg["sizes"]]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the run's JSON (written by allreduce_bench)")
    ap.add_argument("--out", required=True, help="rank 0's rows, JSON lines")
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Longer than gradwire's peer timeout: a rank waits in a barrier while a peer times out.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout_s"] * 3))
    ip = "127.0.0.1" if cfg["net"] == "loopback" else local_ip_towards(os.environ["MASTER_ADDR"])
    sessions = Sessions(cfg, rank, world, ip)
    vs, info = variants(cfg, sessions)
    for v in vs:  # set up now, not inside a case
        if v["impl"] == "gradwire":
            sessions.get(v["algorithm"])
    fabric_pid = [cfg["fabric"]["pid"]] if cfg.get("fabric") else []
    counters = Counters(cfg, rank, gather(os.getpid()) + fabric_pid)
    quiet_gate(counters, cfg)
    barrier = barrier_cost(counters)
    out = open(a.out, "w") if rank == 0 else None
    emit(out, {"kind": "meta", "variants": vs, "algorithms": info, "barrier": barrier,
               "chunk": chunk_length(world), "gradwire_version": gradwire.__version__})  # fmt: skip
    pat: Pattern | None = None
    for rep, size, iters, warmup in schedule(cfg):
        if pat is None or pat.buf.size != size // 4:
            pat = None  # one size's buffers at a time: free the last before allocating
            pat = Pattern(size // 4, rank)
        waited = quiet_gate(counters, cfg)
        for v in vs:
            row = run_case(v, size, iters, warmup, pat, sessions, counters, barrier, cfg)
            emit(out, None if row is None else {"kind": "row", "repeat": rep, "quiet_wait_s": waited, **row})
    sync(False)  # nobody leaves while a peer may still need it
    sessions.close()
    if out:
        out.close()
    dist.destroy_process_group()
    return 0


def emit(out: Any, record: dict | None) -> None:
    """Rank 0: one JSON line, flushed (a run cut short keeps its rows); a row is also logged."""
    if out is None or record is None:
        return
    out.write(json.dumps(record) + "\n")
    out.flush()
    if record["kind"] == "row":
        t = record.get("time_p50_us")
        print(f"[{record['variant']}] {record['size_bytes']} B x{record['ranks']}: "
              + (f"p50 {t:.1f} us" if t is not None else "no time")
              + ("" if record["correct"] else f" FAILED: {record['failure']}"), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
