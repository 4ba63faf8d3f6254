"""Tests of the native binding on 127.0.0.1: every rank of a job is a thread of this process
(the binding releases the GIL, so the ranks run in parallel), except one test that runs the
ranks as processes. Every session has a timeout of a few seconds and every thread is joined
with a deadline, so a broken build fails instead of hanging."""

from __future__ import annotations

import dis
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, List, Sequence

import numpy as np
import pytest

import gradwire
from conftest import REPO, reserve_port

IP = "127.0.0.1"
TIMEOUT = 5.0  # each session's set-up deadline and peer timeout, seconds
JOIN = 30.0  # the longest any group of rank threads may take


def run_ranks(fns: Sequence[Callable[[], Any]], join: float = JOIN) -> List[Any]:
    """Runs each function in its own (daemon) thread; returns the results in order, or raises
    the first exception a function raised."""
    results: List[Any] = [None] * len(fns)
    errors: List[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} did not finish within {join} s"
    for e in errors:
        if e is not None:
            raise e
    return results


def connect(world: int, **kw: Any) -> List[gradwire.Session]:
    """A job of `world` ranks through Endpoint/connect, the table exchanged in-process."""
    kw.setdefault("timeout", TIMEOUT)
    eps = [gradwire.Endpoint(r, world, IP, **kw) for r in range(world)]
    table = [e.address for e in eps]
    return run_ranks([lambda e=e: e.connect(table) for e in eps])


def close_all(sessions: Sequence[gradwire.Session]) -> None:
    for s in sessions:
        s.close()


def needs_root() -> None:
    """The project's rule: skip visibly without root, fail when GRADWIRE_REQUIRE_PRIV=1."""
    if os.geteuid() != 0:
        if os.environ.get("GRADWIRE_REQUIRE_PRIV") == "1":
            pytest.fail("needs root (GRADWIRE_REQUIRE_PRIV=1 forbids skipping)")
        pytest.skip("SKIPPED: needs root")


def close_bounded(sessions: Sequence[gradwire.Session], within: float = 15.0) -> None:
    """close_all from a daemon thread, for tests of what would otherwise deadlock: a session
    stuck in a call (the bug such a test looks for) must fail the test, not hang it in close."""
    t = threading.Thread(target=close_all, args=(sessions,), daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"closing the sessions took over {within} s: a call is stuck in one"


def needs_torch() -> Any:
    """torch, or a visible skip without it; a failure under GRADWIRE_REQUIRE_PRIV=1 (CI),
    where a missing torch must never pass as a skip."""
    try:
        import torch
    except ImportError as e:
        if os.environ.get("GRADWIRE_REQUIRE_PRIV") == "1":
            pytest.fail(f"torch is missing ({e}); GRADWIRE_REQUIRE_PRIV=1 forbids skipping")
        pytest.skip(f"SKIPPED: needs torch ({e})")
    return torch


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def job(request: Any) -> Any:
    sessions = connect(request.param)
    yield sessions
    close_all(sessions)


def check_complete(report: gradwire.ReduceReport, elems: int, world: int) -> None:
    assert report.elems == elems
    assert report.blocks == -(-elems // report.block_elems)
    assert report.complete_blocks == report.blocks
    assert report.delivered_fraction == 1.0
    assert report.rank_delivered == [1.0] * world
    assert report.block_delivered == [1.0] * report.blocks
    assert report.elapsed_s > 0 and report.bytes_sent > 0


# --- collectives -------------------------------------------------------------------------


def test_all_reduce_sum_f32_is_exact(job: List[gradwire.Session]) -> None:
    world, n = len(job), 100_003  # not a whole number of blocks
    base = np.arange(n, dtype=np.float32) % 1000
    arrays = [base * (r + 1) for r in range(world)]
    reports = run_ranks([lambda s=s, a=a: s.all_reduce(a) for s, a in zip(job, arrays)])
    expected = base * sum(range(1, world + 1))
    for a, rep in zip(arrays, reports):
        np.testing.assert_array_equal(a, expected)
        check_complete(rep, n, world)
        assert set(rep.to_dict()) == {
            "elems", "blocks", "block_elems", "complete_blocks", "delivered_fraction",
            "rank_delivered", "block_delivered", "elapsed_s", "bytes_sent",
        }
        assert repr(rep).startswith("ReduceReport(elems=100003,")


def test_all_reduce_sum_f16_is_exact(job: List[gradwire.Session]) -> None:
    world, n = len(job), 4099
    base = (np.arange(n) % 16).astype(np.float16)
    arrays = [(base * (r + 1)).reshape(1, n) for r in range(world)]  # 2-D works too
    run_ranks([lambda s=s, a=a: s.all_reduce(a) for s, a in zip(job, arrays)])
    for a in arrays:
        assert a.dtype == np.float16
        np.testing.assert_array_equal(a[0], base * sum(range(1, world + 1)))


def test_verified_ring_all_reduce_is_exact(job: List[gradwire.Session]) -> None:
    """``verify_results``: every chunk that came round the ring is checked against its
    owner's digest (a changed one is a DataError; the Rust tests change one)."""
    world, n = len(job), 100_003
    base = np.arange(n, dtype=np.float32) % 1000
    arrays = [base * (r + 1) for r in range(world)]
    run_ranks([lambda s=s, a=a: s.all_reduce(a, algorithm="ring", verify_results=True)
               for s, a in zip(job, arrays)])
    works = [s.start_all_reduce(a, algorithm="ring", verify_results=True) for s, a in zip(job, arrays)]
    for w in works:
        w.wait()
    for a in arrays:
        np.testing.assert_array_equal(a, base * sum(range(1, world + 1)) * world)


def test_all_reduce_average(job: List[gradwire.Session]) -> None:
    world = len(job)
    arrays = [np.full(10_000, 2.0 * (r + 1), dtype=np.float32) for r in range(world)]
    run_ranks([lambda s=s, a=a: s.all_reduce(a, op="average") for s, a in zip(job, arrays)])
    for a in arrays:
        np.testing.assert_array_equal(a, np.full(10_000, world + 1.0, dtype=np.float32))


def test_message_stats_count_the_frames_of_an_all_reduce(job: List[gradwire.Session]) -> None:
    world, n = len(job), 50_000  # 200 kB: many segments to each peer
    before = [s.message_stats() for s in job]
    run_ranks([lambda s=s: s.all_reduce(np.ones(n, dtype=np.float32)) for s in job])
    after = [s.message_stats() for s in job]
    payload = 0
    for b, a in zip(before, after):
        assert b is not None and a is not None
        assert set(a) >= {"data_sent", "data_resent", "ctrl_sent", "polls", "nacks", "refused",
                          "datagrams_in", "datagrams_out", "send_calls", "recv_calls"}
        assert all(isinstance(v, int) and v >= 0 for v in a.values())
        sent = a["data_sent"] - b["data_sent"]
        own = a["payload_bytes_sent"] - b["payload_bytes_sent"]
        assert 1500 * sent >= own > 0  # MTU-sized segments (1500-byte default MTU)
        assert a["data_placed"] > b["data_placed"]
        assert a["refused"] == b["refused"] == 0
        payload += own
    # Ring and direct both move (world-1)/world of the tensor per rank in each of two
    # halves: 2 (world-1) tensors over all ranks.
    assert payload >= 2 * (world - 1) * n * 4


def test_adaptive_step_deadlines_keep_the_ranks_in_agreement(job: List[gradwire.Session]) -> None:
    # A fixed and an adaptive time bound under a loss bound: every rank ends with the same
    # values, and each is a sum over the blocks' contributors.
    world, n = len(job), 30_000
    for deadline in (0.5, "adaptive", "adaptive", None):
        arrays = [np.full(n, float(r + 1), dtype=np.float32) for r in range(world)]
        reports = run_ranks([lambda s=s, a=a: s.all_reduce(a, loss_bound=0.01, step_deadline=deadline)
                             for s, a in zip(job, arrays)])
        for a in arrays[1:]:
            np.testing.assert_array_equal(a, arrays[0])
        assert all(r.delivered_fraction > 0.9 for r in reports)


def test_broadcast_copies_the_roots_array(job: List[gradwire.Session]) -> None:
    world, root = len(job), 1
    src = np.random.default_rng(7).standard_normal(50_000).astype(np.float32)
    arrays = [src.copy() if r == root else np.zeros_like(src) for r in range(world)]
    reports = run_ranks([lambda s=s, a=a: s.broadcast(a, root) for s, a in zip(job, arrays)])
    for r, (a, rep) in enumerate(zip(arrays, reports)):
        np.testing.assert_array_equal(a, src)
        if r != root:
            assert rep.received_blocks == rep.blocks > 0
        assert rep.blocks == -(-src.size // rep.block_elems)
        assert rep.block_received == [True] * rep.blocks
        assert set(rep.to_dict()) == {
            "blocks", "block_elems", "received_blocks", "block_received", "elapsed_s",
        }


@pytest.mark.parametrize("world", [2, 3])
def test_barrier_waits_for_the_last_rank(world: int) -> None:
    # Without rank 0 nobody passes the barrier: the others fail at their timeout, whatever
    # the timing (a barrier that did not wait would return None here).
    sessions = connect(world, timeout=1.5)

    def absent(s: gradwire.Session) -> Any:
        try:
            return s.barrier()
        except gradwire.GradwireError as e:
            return e

    try:
        got = run_ranks([lambda s=s: absent(s) for s in sessions[1:]])
        for r, e in enumerate(got, start=1):
            assert isinstance(e, gradwire.PeerError), f"rank {r} passed a barrier rank 0 never entered: {e!r}"
    finally:
        close_all(sessions)
    # With every rank there, every rank passes, and none before rank 0 has entered.
    sessions = connect(world)
    entered = threading.Event()

    def rank(s: gradwire.Session) -> bool:
        if s.rank == 0:
            entered.set()
        assert s.barrier() is None
        return entered.is_set()

    try:
        assert all(run_ranks([lambda s=s: rank(s) for s in sessions]))
    finally:
        close_all(sessions)


def test_rendezvous_threads_world3() -> None:
    port = reserve_port()  # held until the job is set up: rank 0 binds it, nobody else can
    master = f"{IP}:{port.getsockname()[1]}"
    sessions = run_ranks(
        [lambda r=r: gradwire.Session.rendezvous(master, r, 3, IP, timeout=TIMEOUT) for r in range(3)]
    )
    try:
        assert [(s.rank, s.world) for s in sessions] == [(0, 3), (1, 3), (2, 3)]
        arrays = [np.full(1000, r, dtype=np.float32) for r in range(3)]
        run_ranks([lambda s=s, a=a: s.all_reduce(a) for s, a in zip(sessions, arrays)])
        for a in arrays:
            np.testing.assert_array_equal(a, np.full(1000, 3.0, dtype=np.float32))
    finally:
        close_all(sessions)


def test_init_with_the_callers_allgather() -> None:
    world = 3
    table: List[Any] = [None] * world
    gathered = threading.Barrier(world, timeout=JOIN)

    def allgather(rank: int, address: bytes) -> List[bytes]:
        table[rank] = address
        gathered.wait()
        return list(table)

    sessions = run_ranks(
        [
            lambda r=r: gradwire.Session.init(
                lambda a, r=r: allgather(r, a), r, world, IP, timeout=TIMEOUT,
                secret=b"a job secret of 24 bytes",  # every datagram sealed per pair
            )
            for r in range(world)
        ]
    )
    try:
        arrays = [np.full(5000, 1.0, dtype=np.float16) for _ in range(world)]
        run_ranks([lambda s=s, a=a: s.all_reduce(a) for s, a in zip(sessions, arrays)])
        assert all((a == 3.0).all() for a in arrays)
        for s in sessions:
            st = s.message_stats()
            assert s.message_layer and st["unauthenticated"] == 0 and st["replayed"] == 0
    finally:
        close_all(sessions)
    with pytest.raises(ZeroDivisionError):  # the all-gather's own error comes through
        gradwire.Session.init(lambda a: 1 / 0, 0, 2, IP, timeout=TIMEOUT)


def _process_rank(master: str, rank: int, out: Any) -> None:
    try:
        import numpy as np
        import gradwire

        with gradwire.Session.rendezvous(master, rank, 2, "127.0.0.1", timeout=5.0) as s:
            a = np.full(20_000, rank + 1, dtype=np.float32)
            rep = s.all_reduce(a)
            out.put((rank, float(a.min()), float(a.max()), rep.delivered_fraction))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", repr(e), None))


def test_rendezvous_across_processes() -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = reserve_port()  # held until the ranks are done: rank 0 binds it, nobody else can
    master = f"{IP}:{port.getsockname()[1]}"
    procs = [ctx.Process(target=_process_rank, args=(master, r, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=JOIN) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == [(0, 3.0, 3.0, 1.0), (1, 3.0, 3.0, 1.0)]


# --- point to point ----------------------------------------------------------------------


def test_send_recv_with_each_kind_of_priority() -> None:
    s0, s1 = connect(2)
    try:
        src = np.random.default_rng(1).standard_normal(30_000).astype(np.float32)
        src.setflags(write=False)  # send only reads: a read-only array is fine
        calls: List[tuple] = []

        def prio(index: int, offset: int, layer: int, payload: bytes) -> tuple:
            calls.append((index, offset, layer, payload))
            return (10 + index % 4, index % 2 == 0)

        for tensor, priority in [(1, None), (2, 46), (3, prio)]:
            dst = np.zeros_like(src)
            sent, got = run_ranks(
                [
                    lambda: s0.send(src, 1, tensor=tensor, layer=3, priority=priority),
                    lambda: s1.recv(dst, 0, tensor=tensor, layer=3),
                ]
            )
            np.testing.assert_array_equal(dst, src)
            assert sent.segments == got.segments == got.received_segments > 1
            assert sent.bytes == src.nbytes
            assert got.delivered_fraction == 1.0 and got.loss_bound == 0.0
            assert got.missing == []
            assert set(sent.to_dict()) == {
                "segments", "bytes", "retransmitted_segments", "elapsed_s", "final_rate_bps",
            }
            assert repr(got).startswith("RecvReport(")
        # The callable saw every segment, with its offset, layer and bytes.
        seen = {c[0]: c for c in calls}
        assert sorted(seen) == list(range(sent.segments))
        raw = src.tobytes()
        for index, offset, layer, payload in seen.values():
            assert layer == 3
            assert raw[offset : offset + len(payload)] == payload
    finally:
        close_all([s0, s1])


# Runs in a network namespace of its own (`unshare --net`), so that the only UDP packets on
# its loopback are this job's: a raw socket sees every one with its IP header, whose TOS byte
# carries the DSCP and ECN. Each packet is identified by its own gradwire header (the flow's
# tensor id and the segment's offset), never by when it came; the sniff ends at a marker
# datagram sent after the last case, which the raw socket queues after every packet the
# receiver took. Prints, per case, the packets' (offset, pass, dscp, ecn) and the tags the
# priority callable returned for each offset, as JSON.
_SNIFF_PRELUDE = r"""
import json, socket, struct, subprocess, sys, threading
import numpy as np, gradwire

END = b"gradwire sniff: end of the test's packets"
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
sniff = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
sniff.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: nothing dropped
sniff.settimeout(60)  # bounded: no end marker within a minute fails the script


def packets():
    # (tos, port, payload) of every UDP packet on the namespace's loopback.
    while True:
        pkt = sniff.recv(65536)
        ihl = (pkt[0] & 0x0F) * 4
        udp = pkt[ihl:]
        yield pkt[1], struct.unpack("!H", udp[2:4])[0], udp[8:]


def segments(payload):
    # The message-layer data segments of a GSO bundle (whole on loopback), as (offset,
    # total, meta, pass), empty messages (barrier tokens) left out.
    while payload:
        n = 40 + struct.unpack("!H", payload[28:30])[0]
        seg, payload = payload[:n], payload[n:]
        offset, = struct.unpack("!Q", seg[16:24])
        total, = struct.unpack("!I", seg[24:28])
        meta, = struct.unpack("!Q", seg[32:40])
        if total:
            yield offset, total, meta, seg[3]
"""

_DSCP_SCRIPT = _SNIFF_PRELUDE + r"""
seen = []  # (tensor id, offset, pass, dscp, ecn)

def sniffer():
    for tos, port, payload in packets():
        if port == 9 and payload == END:
            return
        assert len(payload) >= 8 and payload[0] == 1, f"not a gradwire packet: {len(payload)} bytes"
        if payload[1] == 5:
            continue  # a message-layer control frame (control DSCP, not checked here)
        if payload[1] == 3:
            # The point-to-point tensor id rides in each segment's meta word.
            for offset, _, meta, pass_ in segments(payload):
                seen.append(((7 << 27) | meta, offset, pass_, tos >> 2, tos & 3))
            continue
        tensor, = struct.unpack("!I", payload[8:12])
        offset, = struct.unpack("!Q", payload[16:24])
        seen.append((tensor, offset, payload[3], tos >> 2, tos & 3))

def both(f0, f1):
    out, ts = [None, None], []
    for i, f in enumerate((f0, f1)):
        ts.append(threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f()), daemon=True))
        ts[-1].start()
    for t in ts:
        t.join(30)
    assert None not in out, "a rank failed or hung"
    return out

reader = threading.Thread(target=sniffer, daemon=True)
reader.start()  # the socket exists already: nothing sent from here on is missed
eps = [gradwire.Endpoint(r, 2, "127.0.0.1", timeout=5.0) for r in range(2)]
table = [e.address for e in eps]
s0, s1 = both(lambda: eps[0].connect(table), lambda: eps[1].connect(table))
src = (np.arange(20_000) % 7).astype(np.float32)
cases = json.loads(sys.argv[1])
tags = [dict() for _ in cases]
for i, (layer, num_layers, priority) in enumerate(cases):
    if priority == "callable":
        def priority(index, offset, layer, payload, tags=tags[i]):
            tag = ((index * 7 + 3) % 64, index % 3 == 0)
            tags[offset] = tag
            return tag
    dst = np.zeros_like(src)
    both(
        lambda: s0.send(src, 1, tensor=i, layer=layer, num_layers=num_layers, priority=priority),
        lambda: s1.recv(dst, 0, tensor=i, layer=layer, num_layers=num_layers),
    )
    assert (dst == src).all()
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
    u.sendto(END, ("127.0.0.1", 9))
reader.join(90)
assert not reader.is_alive(), "the sniffer never saw the end marker"
flows = {(7 << 27) | i for i in range(len(cases))}
assert all(p[0] in flows for p in seen), [p for p in seen if p[0] not in flows][:5]
print(json.dumps([
    {"packets": [p[1:] for p in seen if p[0] == (7 << 27) | i],
     "tags": {str(o): t for o, t in tags[i].items()}}
    for i in range(len(cases))
]))
"""


def _sniff_dscp(cases: list) -> list:
    proc = subprocess.run(
        ["unshare", "--net", "--", sys.executable, "-c", _DSCP_SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_default_tagging_puts_the_layers_dscp_on_the_data_packets() -> None:
    needs_root()
    # (layer, num_layers) -> the DSCP DLCP gives it (gradwire-qos: layer x of L is priority
    # floor(7x/L), 0 the most urgent, on DSCP 46, 40, 34, 26, 18, 10, 0); 0 layers: unknown,
    # the lowest data priority.
    cases = {(0, 4): 46, (1, 4): 40, (3, 4): 10, (5, 0): 0}
    seen = _sniff_dscp([[layer, n, None] for layer, n in cases])
    for ((layer, num_layers), dscp), case in zip(cases.items(), seen):
        dscps = [p[2] for p in case["packets"]]
        assert len(dscps) > 1, f"layer {layer} of {num_layers}: no packets seen"
        assert set(dscps) == {dscp}, f"layer {layer} of {num_layers}: want DSCP {dscp}, saw {dscps}"


# Two ranks all-reduce, in a namespace of their own, a tensor whose first half is large and
# second half tiny, under a loss bound; a raw socket records each data segment's (offset,
# meta, ecn). Prints {tagging: [[offset, meta, ecn], ...]} as JSON.
_REDUCE_TAGS_SCRIPT = _SNIFF_PRELUDE + r"""
seen = []  # (offset, total, ecn) of each data segment

def sniffer():
    for tos, port, payload in packets():
        if port == 9:
            if payload == END:
                return
            seen.append(None)  # the marker between the two all-reduces
            continue
        if len(payload) < 40 or payload[0] != 1 or payload[1] != 3:
            continue  # control frames, set-up
        for offset, total, _, _ in segments(payload):
            seen.append((offset, total, tos & 3))

reader = threading.Thread(target=sniffer, daemon=True)
reader.start()
sessions = [None, None]
eps = [gradwire.Endpoint(r, 2, "127.0.0.1", timeout=5.0, loss_bound=0.1) for r in range(2)]
table = [e.address for e in eps]
ts = [threading.Thread(target=lambda r=r: sessions.__setitem__(r, eps[r].connect(table))) for r in range(2)]
[t.start() for t in ts]; [t.join(30) for t in ts]
n = 40_000
for tagging in ("magnitude", "layer"):
    arrays = [np.concatenate([np.full(n // 2, 100.0 + r), np.full(n // 2, 1e-3)]).astype(np.float32) for r in range(2)]
    ts = [threading.Thread(target=lambda r=r: sessions[r].all_reduce(arrays[r], tagging=tagging)) for r in range(2)]
    [t.start() for t in ts]; [t.join(30) for t in ts]
    assert abs(float(arrays[0][0]) - 201.0) < 1e-3 and abs(float(arrays[0][-1]) - 2e-3) < 1e-6, arrays[0][[0, -1]]
    # A marker after each all-reduce: the raw socket queues it after all of its packets.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.sendto(END if tagging == "layer" else b"next", ("127.0.0.1", 9))
reader.join(90)
assert not reader.is_alive(), "the sniffer never saw the end marker"
split = seen.index(None)
print(json.dumps({"magnitude": seen[:split], "layer": seen[split + 1:]}))
"""


def test_a_bounded_all_reduce_tags_its_segments_by_gradient_magnitude() -> None:
    """DLCP's magnitude tagging through the all-reduce: the lossy step's segments of tiny
    gradients go not-ECT (the first a congested switch drops), the large ones and every
    result stay ECN-capable; ``tagging="layer"`` keeps every segment ECN-capable."""
    needs_root()
    proc = subprocess.run(
        ["unshare", "--net", "--", sys.executable, "-c", _REDUCE_TAGS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    half = 40_000 // 2 * 4
    mag = seen["magnitude"]
    assert mag, "no data segments seen"
    not_ect = [p for p in mag if p[2] == 0]
    assert not_ect, "no segment of the tiny half went not-ECT"
    assert all(p[2] in (0, 2) for p in mag), mag[:5]
    # Each not-ECT segment holds tiny gradients: chunk 0 (whole blocks, a little over half
    # the tensor) starts at byte 0, chunk 1 ends the tensor; the tiny half starts at `half`.
    size = 2 * half
    for offset, total, _ in not_ect:
        start = offset if total >= half else size - total + offset
        assert start + 1432 > half, (offset, total)
    # The tiny chunk's contribution (about 56 segments of 1432 bytes) went not-ECT; its
    # result sent back, and the large chunk, went ECN-capable.
    assert len(not_ect) >= 40 and len(not_ect) <= len(mag) // 3, (len(not_ect), len(mag))
    assert all(p[2] == 2 for p in seen["layer"]), [p for p in seen["layer"] if p[2] != 2][:5]


def test_a_priority_int_and_callable_set_each_packets_dscp_on_the_wire() -> None:
    needs_root()
    fixed, func, default = _sniff_dscp([[3, 8, 46], [3, 8, "callable"], [0, 4, None]])
    assert len(fixed["packets"]) > 1 and {p[2] for p in fixed["packets"]} == {46}, fixed
    assert len(default["packets"]) > 1 and {p[2] for p in default["packets"]} == {46}, default
    tags = {int(o): t for o, t in func["tags"].items()}
    assert len({t[0] for t in tags.values()}) > 3, f"the callable's tags should vary: {tags}"
    assert len(func["packets"]) > 1
    for offset, pass_, dscp, ecn in func["packets"]:
        assert offset in tags, f"a packet at offset {offset} the callable never tagged"
        want_dscp, want_ect = tags[offset]
        assert dscp == want_dscp, (offset, dscp, tags[offset])
        # Retransmission passes may make a segment ECN-capable on their own.
        if pass_ == 0 or want_ect:
            assert ecn == (2 if want_ect else 0), (offset, pass_, ecn, tags[offset])


def test_a_failing_priority_callable_raises_after_the_transfer() -> None:
    s0, s1 = connect(2)
    try:
        src = np.arange(20_000, dtype=np.float32)
        dst = np.zeros_like(src)

        def bad(index: int, offset: int, layer: int, payload: bytes) -> tuple:
            if index == 2:
                raise KeyError("no tag for this one")
            return (0, True)

        box: List[Any] = [None]

        def sender() -> None:
            try:
                s0.send(src, 1, priority=bad)
            except gradwire.ConfigError as e:
                box[0] = e

        run_ranks([sender, lambda: s1.recv(dst, 0)])
        e = box[0]
        assert isinstance(e, gradwire.ConfigError), "the callable's failure was not raised"
        assert "segment 2" in str(e) and isinstance(e.__cause__, KeyError)
        np.testing.assert_array_equal(dst, src)  # the transfer itself completed
        for wrong in (64, -1, True, "high", 1.5):
            with pytest.raises(gradwire.ConfigError):
                s0.send(src, 1, priority=wrong)
    finally:
        close_all([s0, s1])


# --- loss --------------------------------------------------------------------------------


def test_inject_loss_all_reduce_respects_the_bound() -> None:
    bound, world = 0.2, 3
    sessions = connect(world, inject_loss=0.05, seed=11, loss_bound=bound)
    try:
        x = (np.arange(200_000) % 50).astype(np.float32)
        arrays = [x.copy() for _ in range(world)]
        reports = run_ranks([lambda s=s, a=a: s.all_reduce(a) for s, a in zip(sessions, arrays)])
        for a, rep in zip(arrays, reports):
            assert rep.delivered_fraction >= 1 - bound
            assert len(rep.rank_delivered) == world
            assert len(rep.block_delivered) == rep.blocks == -(-x.size // rep.block_elems)
            assert rep.complete_blocks == sum(b == 1.0 for b in rep.block_delivered)
            assert rep.delivered_fraction == pytest.approx(np.mean(rep.block_delivered))
            assert all(0.0 <= f <= 1.0 for f in rep.rank_delivered)
            # Every rank gave x: a block's sum, estimated from the ranks that arrived, is
            # world * x exactly wherever any contribution arrived.
            for b, frac in enumerate(rep.block_delivered):
                if frac > 0:
                    sl = slice(b * rep.block_elems, (b + 1) * rep.block_elems)
                    np.testing.assert_array_equal(a[sl], x[sl] * world)
    finally:
        close_all(sessions)


def test_inject_loss_holds_every_range_to_the_bound() -> None:
    """``ranges=``: many small parameters in one flat tensor each deliver at least
    ``1 - bound`` (element-weighted over their blocks), started or blocking; bad ranges are
    a ConfigError naming them."""
    bound, world = 0.1, 3
    sessions = connect(world, inject_loss=0.08, seed=3, loss_bound=bound)
    try:
        sizes = [7, 3000, 40, 900, 2, 15000] * 6
        edges = np.cumsum([0] + sizes)
        ranges = [(int(a), int(b)) for a, b in zip(edges, edges[1:])]
        n = int(edges[-1])
        for started in (False, True):
            arrays = [np.ones(n, dtype=np.float32) for _ in range(world)]

            def run(s, a):
                if started:
                    return s.start_all_reduce(a, ranges=ranges).wait(30)
                return s.all_reduce(a, ranges=ranges)

            reports = run_ranks([lambda s=s, a=a: run(s, a) for s, a in zip(sessions, arrays)])
            for rep in reports:
                per_elem = np.repeat(rep.block_delivered, rep.block_elems)[:n]
                for a, b in ranges:
                    got = float(per_elem[a:b].mean())
                    assert got >= 1 - bound - 1e-9, (started, a, b, got)
        with pytest.raises(gradwire.ConfigError, match="ranges"):
            sessions[0].all_reduce(np.ones(10, dtype=np.float32), ranges=[(0, 5), (3, 8)])
    finally:
        close_all(sessions)


def test_inject_loss_recv_respects_the_bound() -> None:
    bound = 0.25
    s0, s1 = connect(2, inject_loss=0.1, seed=5)
    try:
        src = np.ones(100_000, dtype=np.float32)
        dst = np.zeros_like(src)
        _, got = run_ranks(
            [lambda: s0.send(src, 1, loss_bound=bound), lambda: s1.recv(dst, 0, loss_bound=bound)]
        )
        assert got.loss_bound == bound
        assert got.delivered_fraction >= 1 - bound
        assert got.delivered_fraction == pytest.approx(got.received_segments / got.segments)
        assert np.count_nonzero(dst) >= (1 - bound) * dst.size * 0.99
        assert set(np.unique(dst)) <= {0.0, 1.0}  # lost segments are zero, never garbage
        # The missing byte ranges are exactly the zeros: in order, whole elements.
        assert (got.received_segments < got.segments) == (got.missing != [])
        zero = np.zeros(dst.size, dtype=bool)
        end = 0
        for offset, length in got.missing:
            assert offset >= end and length > 0 and offset % 4 == 0 and length % 4 == 0
            zero[offset // 4 : (offset + length) // 4] = True
            end = offset + length
        assert end <= dst.nbytes
        np.testing.assert_array_equal(dst == 0.0, zero)
        assert "missing=" in repr(got) and got.to_dict()["missing"] == got.missing
    finally:
        close_all([s0, s1])


def test_inject_loss_broadcast_reports_which_blocks_arrived() -> None:
    s0, s1 = connect(2, inject_loss=0.1, seed=9, loss_bound=0.3)
    try:
        n = 100_000
        src = np.arange(n, dtype=np.float32)
        dst = np.full(n, -1.0, dtype=np.float32)
        _, rep = run_ranks([lambda: s0.broadcast(src, 0), lambda: s1.broadcast(dst, 0)])
        assert len(rep.block_received) == rep.blocks == -(-n // rep.block_elems)
        assert sum(rep.block_received) == rep.received_blocks
        assert rep.received_blocks < rep.blocks, "10 % loss with a 30 % bound loses blocks"
        for b, arrived in enumerate(rep.block_received):
            sl = slice(b * rep.block_elems, (b + 1) * rep.block_elems)
            # A block that did not arrive kept this rank's previous contents.
            np.testing.assert_array_equal(dst[sl], src[sl] if arrived else -1.0)
    finally:
        close_all([s0, s1])


# --- torch -------------------------------------------------------------------------------


def test_torch_tensors_in_place() -> None:
    torch = needs_torch()
    s0, s1 = connect(2)
    try:
        # bfloat16 (numpy has none: an int16 view with the dtype hint), exact small ints.
        ts = [torch.arange(5000, dtype=torch.bfloat16) % 32 * (r + 1) for r in range(2)]
        expected = (torch.arange(5000, dtype=torch.bfloat16) % 32) * 3
        run_ranks([lambda: s0.all_reduce(ts[0]), lambda: s1.all_reduce(ts[1])])
        for t in ts:
            assert t.dtype == torch.bfloat16 and torch.equal(t, expected)
        # float32 parameters that require grad: their memory, in place.
        ps = [torch.nn.Parameter(torch.full((64, 33), float(r + 1))) for r in range(2)]
        ptr = ps[0].data_ptr()
        run_ranks([lambda: s0.all_reduce(ps[0], op="average"), lambda: s1.all_reduce(ps[1], op="average")])
        assert ps[0].data_ptr() == ptr and torch.all(ps[0] == 1.5) and torch.all(ps[1] == 1.5)
        # float16 point to point.
        a = torch.randn(3000).half()
        b = torch.zeros(3000, dtype=torch.float16)
        run_ranks([lambda: s0.send(a, 1), lambda: s1.recv(b, 0)])
        assert torch.equal(a, b)
        # Wrong use: non-contiguous, wrong dtype, integer.
        with pytest.raises(gradwire.ConfigError, match="contiguous"):
            s0.all_reduce(torch.zeros(10, 10).t())
        with pytest.raises(gradwire.ConfigError, match="float64"):
            s0.all_reduce(torch.zeros(10, dtype=torch.float64))
        with pytest.raises(gradwire.ConfigError, match="int32"):
            s0.all_reduce(torch.zeros(10, dtype=torch.int32))
    finally:
        close_all([s0, s1])


def test_overlapping_operations_on_one_torch_tensor_are_refused() -> None:
    # numpy's borrow tracking cannot see these: each t.numpy() view has a new base object.
    torch = needs_torch()
    s0, s1 = connect(2)
    try:
        t = torch.arange(20_000, dtype=torch.float32)
        dst = torch.zeros(20_000)
        refused: List[Any] = []

        def prio(index: int, offset: int, layer: int, payload: bytes) -> tuple:
            # Runs inside s0.send(t): t is in use (read) until the send returns. Operations
            # writing into its memory, from another session, must fail at once rather than
            # write under the send (or wait for it: s1 is busy receiving this very send).
            if index == 0:
                for attempt in (
                    lambda: s1.all_reduce(t),
                    lambda: s1.recv(t[100:200], 0),
                    lambda: s1.broadcast(t.view(100, 200)[50], 0),
                ):
                    try:
                        attempt()
                    except gradwire.ConfigError as e:
                        refused.append(str(e))
            return (0, True)

        run_ranks([lambda: s0.send(t, 1, priority=prio), lambda: s1.recv(dst, 0)])
        assert len(refused) == 3, refused
        assert all("in use by another gradwire operation" in m for m in refused), refused
        assert torch.equal(dst, t)
        # The memory is released when an operation returns: t can be used again.
        u = torch.ones(20_000)
        run_ranks([lambda: s0.all_reduce(t), lambda: s1.all_reduce(u)])
        assert torch.equal(t, torch.arange(20_000, dtype=torch.float32) + 1)
    finally:
        close_bounded([s0, s1])


def test_numpy_arrays_do_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, gradwire\n"
        "try:\n"
        "    gradwire.Session.all_reduce\n"
        "    gradwire._as_array(np.zeros(3, np.float32))\n"
        "    gradwire._as_array([1.0])\n"
        "except gradwire.ConfigError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- errors ------------------------------------------------------------------------------


def test_wrong_arrays_raise_config_error() -> None:
    s0, s1 = connect(2)
    try:
        cases = {
            "float64": np.zeros(10),
            "int32": np.zeros(10, dtype=np.int32),
            "read-only": np.zeros(10, dtype=np.float32),
            "contiguous": np.zeros(20, dtype=np.float32)[::2],
            "contiguous (F)": np.zeros((4, 5), dtype=np.float32, order="F"),
            "byte order": np.zeros(10, dtype=">f4"),
            "numpy.ndarray": [1.0, 2.0],
        }
        cases["read-only"].setflags(write=False)
        for what, a in cases.items():
            with pytest.raises(gradwire.ConfigError) as info:
                s0.all_reduce(a)
            e = info.value
            assert isinstance(e, ValueError) and isinstance(e, gradwire.GradwireError)
            assert (e.kind, e.code, e.peer) == ("invalid_argument", 1, None)
            assert what.split(" (")[0] in str(e), (what, str(e))
        with pytest.raises(gradwire.ConfigError, match="read-only"):
            s1.recv(cases["read-only"], 0)
        unaligned = np.frombuffer(bytearray(41), dtype=np.float32, offset=1)
        with pytest.raises(gradwire.ConfigError, match="aligned"):
            s0.all_reduce(unaligned)
        # The session is still usable after refused arguments.
        arrays = [np.ones(100, dtype=np.float32) for _ in range(2)]
        run_ranks([lambda: s0.all_reduce(arrays[0]), lambda: s1.all_reduce(arrays[1])])
        assert arrays[0][0] == 2.0
    finally:
        close_all([s0, s1])


def test_bad_arguments_raise_config_error() -> None:
    with pytest.raises(gradwire.ConfigError, match="rank 2"):
        gradwire.Endpoint(2, 2, IP)
    with pytest.raises(gradwire.ConfigError, match="rank -1"):
        gradwire.Endpoint(-1, 2, IP)
    with pytest.raises(gradwire.ConfigError, match="not an IP address"):
        gradwire.Endpoint(0, 2, "localhost:5")
    with pytest.raises(gradwire.ConfigError, match="loss bound 1"):
        gradwire.Endpoint(0, 2, IP, loss_bound=1.0)
    with pytest.raises(gradwire.ConfigError, match="timeout"):
        gradwire.Endpoint(0, 2, IP, timeout=0)
    with pytest.raises(gradwire.ConfigError):
        gradwire.Endpoint(0, 2, IP, secret=b"short")
    with pytest.raises(gradwire.ConfigError, match="encode"):
        gradwire.Endpoint(0, 2, IP, secret="a str, not bytes, of 32 chars...")
    with pytest.raises(gradwire.ConfigError, match="master"):
        gradwire.Session.rendezvous("nowhere", 0, 2, IP)
    for seed in (-1, 2**64, -(2**70)):
        with pytest.raises(gradwire.ConfigError, match=f"seed {seed} is outside"):
            gradwire.Endpoint(0, 2, IP, seed=seed)
    gradwire.Endpoint(0, 2, IP, seed=2**64 - 1)  # the whole u64 range is fine
    s0, s1 = connect(2)
    try:
        a = np.zeros(100, dtype=np.float32)
        for bound in (1.0, 1.5, -0.1, float("nan")):
            with pytest.raises(gradwire.ConfigError, match="loss_bound"):
                s0.all_reduce(a, loss_bound=bound)
        with pytest.raises(gradwire.ConfigError, match="op"):
            s0.all_reduce(a, op="median")
        with pytest.raises(gradwire.ConfigError, match="dscp"):
            s0.all_reduce(a, dscp=64)
        with pytest.raises(gradwire.ConfigError, match="layer"):
            s0.all_reduce(a, layer=70_000)
        with pytest.raises(gradwire.ConfigError, match='algorithm "tree" is not one of'):
            s0.all_reduce(a, algorithm="tree")
        for d in (0, -1.0, float("nan"), float("inf"), "soon", [1]):
            with pytest.raises(gradwire.ConfigError, match="step_deadline"):
                s0.all_reduce(a, step_deadline=d)
        for root in (2, 9):
            with pytest.raises(gradwire.ConfigError, match=f"root {root} is not a rank"):
                s0.broadcast(a, root)
        with pytest.raises(gradwire.ConfigError, match="root -1 must be >= 0"):
            s0.broadcast(a, -1)
        with pytest.raises(gradwire.ConfigError, match="layer 4 is not below num_layers 4"):
            s0.send(a, 1, layer=4, num_layers=4)  # DLCP's tagging needs the layer's DSCP
        with pytest.raises(gradwire.ConfigError, match="num_layers"):
            s0.send(a, 1, num_layers=-1)
        with pytest.raises(gradwire.ConfigError):
            s0.send(a, 5)  # peer >= world
        with pytest.raises(gradwire.ConfigError):
            s0.send(a, 0)  # itself
    finally:
        close_all([s0, s1])


def test_a_ring_only_session_refuses_transfers_off_the_ring_and_says_why() -> None:
    sessions = connect(3, point_to_point=False)
    try:
        s0, s1 = sessions[0], sessions[1]
        src = np.arange(1000, dtype=np.float32)
        dst = np.zeros_like(src)
        # Rank 0 is linked to rank 1 (next on the ring) and from rank 2 (previous) only.
        with pytest.raises(gradwire.ConfigError, match="no link to rank 2") as info:
            s0.send(src, 2)
        assert "point_to_point=True" in str(info.value)
        with pytest.raises(gradwire.ConfigError, match="no link from rank 1"):
            s0.recv(dst, 1)
        # Along the ring it works, and the refusals left the session usable.
        run_ranks([lambda: s0.send(src, 1), lambda: s1.recv(dst, 0)])
        np.testing.assert_array_equal(dst, src)
        run_ranks([lambda s=s: s.barrier() for s in sessions])
    finally:
        close_all(sessions)


def test_a_peer_that_never_connects_fails_within_the_timeout() -> None:
    a = gradwire.Endpoint(0, 2, IP, timeout=2.0)
    b = gradwire.Endpoint(1, 2, IP, timeout=2.0)
    table = [a.address, b.address]
    del b  # rank 1 never connects
    start = time.monotonic()
    with pytest.raises((gradwire.SetupError, gradwire.PeerError)) as info:
        run_ranks([lambda: a.connect(table)], join=15)
    assert time.monotonic() - start < 10
    assert info.value.kind in ("setup", "peer") and info.value.code in (2, 3)
    with pytest.raises(gradwire.UnusableError, match="already connected"):
        a.connect(table)


def test_rendezvous_without_the_other_ranks_fails_within_the_timeout() -> None:
    port = reserve_port()
    start = time.monotonic()
    with pytest.raises((gradwire.SetupError, gradwire.PeerError)):
        run_ranks(
            [lambda: gradwire.Session.rendezvous(f"{IP}:{port.getsockname()[1]}", 0, 2, IP, timeout=2.0)],
            join=15,
        )
    assert time.monotonic() - start < 10


def test_a_peer_that_dies_raises_peer_error_naming_it() -> None:
    sessions = connect(3, timeout=2.0)
    sessions[2].close()  # rank 2 dies: its links close
    arrays = [np.ones(50_000, dtype=np.float32) for _ in range(2)]
    box: List[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            sessions[r].all_reduce(arrays[r])
        except gradwire.GradwireError as e:
            box[r] = e

    start = time.monotonic()
    run_ranks([lambda: rank(0), lambda: rank(1)])
    assert time.monotonic() - start < 15
    for e in box:
        assert isinstance(e, gradwire.PeerError), repr(e)
        assert e.kind == "peer" and e.code == 3
    # The ring is 0 -> 1 -> 2 -> 0: rank 0 receives from rank 2 and finds it gone. Rank 1
    # sends to rank 2, but may instead time out on rank 0, which stopped.
    assert box[0].peer == 2, repr(box[0])
    assert box[1].peer in (0, 2), repr(box[1])
    with pytest.raises(gradwire.UnusableError):
        sessions[0].barrier()  # unusable after a failure
    close_all(sessions)


def test_use_after_close_raises_unusable() -> None:
    sessions = connect(2)
    with sessions[0] as s:
        assert not s.closed and repr(s) == "Session(rank=0, world=2)"
    assert sessions[0].closed
    sessions[0].close()  # idempotent
    for call in (
        lambda s: s.all_reduce(np.zeros(4, np.float32)),
        lambda s: s.broadcast(np.zeros(4, np.float32), 0),
        lambda s: s.barrier(),
        lambda s: s.send(np.zeros(4, np.float32), 1),
        lambda s: s.recv(np.zeros(4, np.float32), 1),
    ):
        with pytest.raises(gradwire.UnusableError) as info:
            call(sessions[0])
        assert (info.value.kind, info.value.code) == ("unusable", 4)
        assert "closed" in str(info.value)
    assert (sessions[0].rank, sessions[0].world) == (0, 2)
    sessions[1].close()


# --- threads -----------------------------------------------------------------------------


def _last_call(fn: Callable[..., Any]) -> int:
    """The bytecode offset of the last call `fn` makes."""
    calls = ("CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD")
    return [i.offset for i in dis.get_instructions(fn) if i.opname in calls][-1]


def _inside_last_call(fn: Callable[..., Any], ident: int) -> bool:
    """Whether thread `ident` is stopped inside the last call `fn` makes: its innermost
    frame is `fn`'s, at that call. The caller holds the GIL to look, so a thread stopped
    there is in native code that released the GIL (or the call already returned, which a
    call still waiting for its peer cannot have)."""
    frame = sys._current_frames().get(ident)
    return (
        frame is not None and frame.f_code is fn.__code__ and frame.f_lasti == _last_call(fn)
    )


def test_a_second_thread_waits_and_the_gil_is_released() -> None:
    s0, s1 = connect(2)
    try:
        x0 = np.full(10_000, 1.0, dtype=np.float32)
        y0 = np.full(10_000, 10.0, dtype=np.float32)
        x1 = np.full(10_000, 100.0, dtype=np.float32)
        y1 = np.full(10_000, 1000.0, dtype=np.float32)
        idents: dict = {}

        def first() -> None:
            idents[first] = threading.get_ident()
            s0.all_reduce(x0)

        def second() -> None:
            idents[second] = threading.get_ident()
            s0.all_reduce(y0)

        # Rank 1 is a Python thread too. It calls in only once both of rank 0's calls are
        # inside the binding with the GIL released, as it sees them: one holds the session
        # and waits for rank 1, the other waits for the session. A call holding the GIL while
        # it waits would keep rank 1 from looking at all, until that call failed (PeerError).
        def rank1() -> None:
            calls = (first, second)
            deadline = time.monotonic() + TIMEOUT
            while not all(f in idents and _inside_last_call(f, idents[f]) for f in calls):
                assert time.monotonic() < deadline, "rank 0's two calls never both waited"
                time.sleep(0.001)  # polling what the threads are doing, not waiting for luck
            s1.all_reduce(x1)
            s1.all_reduce(y1)

        run_ranks([first, second, rank1])
        # Both of rank 0's calls ran, one after the other, each paired with one of rank 1's:
        # x0 with x1 and y0 with y1, or (if the second thread got the session first) y0 with
        # x1 and x0 with y1.
        got = sorted([float(x0[0]), float(y0[0])])
        assert got in ([101.0, 1010.0], [110.0, 1001.0]), got
    finally:
        close_all([s0, s1])


def test_a_priority_callable_using_its_own_session_raises_instead_of_deadlocking() -> None:
    s0, s1 = connect(2)
    try:
        src = np.arange(20_000, dtype=np.float32)
        calls = {
            "barrier": lambda: s0.barrier(),
            "close": lambda: s0.close(),
            "send": lambda: s0.send(src, 1, tensor=9),
            "all_reduce": lambda: s0.all_reduce(np.ones(4, np.float32)),
        }
        for tensor, (name, call) in enumerate(calls.items()):
            dst = np.zeros_like(src)

            def prio(index: int, offset: int, layer: int, payload: bytes) -> tuple:
                if index == 0:
                    call()  # raises: s0 is inside the send that calls this
                return (0, True)

            box: List[Any] = [None]

            def sender() -> None:
                try:
                    s0.send(src, 1, tensor=tensor, priority=prio)
                except gradwire.ConfigError as e:
                    box[0] = e

            start = time.monotonic()
            run_ranks([sender, lambda: s1.recv(dst, 0, tensor=tensor)], join=20)
            assert time.monotonic() - start < 10, name
            e = box[0]
            assert isinstance(e, gradwire.ConfigError), f"{name}: nothing raised"
            assert "segment 0" in str(e), str(e)
            assert isinstance(e.__cause__, gradwire.ConfigError), repr(e.__cause__)
            assert "may not use its own session" in str(e.__cause__), str(e.__cause__)
            assert str(e.__cause__).startswith(name), str(e.__cause__)
            np.testing.assert_array_equal(dst, src)  # the transfer itself completed
        # None of it touched the session: it still works, and closes normally.
        assert not s0.closed
        a = [np.ones(8, np.float32), np.ones(8, np.float32)]
        run_ranks([lambda: s0.all_reduce(a[0]), lambda: s1.all_reduce(a[1])])
        assert a[0][0] == 2.0
    finally:
        close_bounded([s0, s1])


def test_exception_classes() -> None:
    assert issubclass(gradwire.ConfigError, ValueError)
    for name, kind, code in [
        ("ConfigError", "invalid_argument", 1),
        ("SetupError", "setup", 2),
        ("PeerError", "peer", 3),
        ("UnusableError", "unusable", 4),
        ("DataError", "data", 5),
        ("InternalError", "internal", 6),
    ]:
        cls = getattr(gradwire, name)
        assert issubclass(cls, gradwire.GradwireError) and issubclass(cls, RuntimeError)
        assert (cls.kind, cls.code) == (kind, code)
    assert gradwire.__version__ == gradwire._native.__version__


@pytest.mark.parametrize(
    "mask, what",
    [
        (0b11, "names a rank it cannot carry"),
        (0b01, "leaves out the rank whose values it carries"),
        (1 << 5, "names a rank beyond the world"),
    ],
)
def test_forged_aggregation_data_is_a_data_error_naming_the_peer(
    forged_peer_exe: Any, tmp_path: Any, mask: int, what: str
) -> None:
    """A forged rank 1 (capi/examples/forged_peer.rs: a real endpoint, a hand-made message)
    sends rank 0's first all-reduce its contribution under a contributor set that also claims
    rank 0's (counted twice if accepted), leaves rank 1 out, or names a rank outside the job:
    rank 0 raises DataError naming it."""
    from conftest import LineChild

    ep = gradwire.Endpoint(0, 2, IP, loss_bound=0.1, timeout=TIMEOUT)  # sets travel only then
    argv = [str(forged_peer_exe), "--mask", f"{mask:x}", "--bound", "0.1", "--elems", "8"]
    with LineChild(argv, tmp_path / "forged.log") as peer:
        kind, _, theirs = peer.read_line(JOIN).partition(" ")
        assert kind == "endpoint", kind
        peer.write_line(ep.address.hex())
        s = run_ranks([lambda: ep.connect([ep.address, bytes.fromhex(theirs)])])[0]
        try:
            # The forged message is accepted only inside this all-reduce.
            x = np.full(8, 2.0, dtype=np.float32)
            with pytest.raises(gradwire.GradwireError) as err:
                run_ranks([lambda: s.all_reduce(x)])
            assert peer.read_line(JOIN) == "forged"
            e = err.value
            assert type(e) is gradwire.DataError, f"{type(e).__name__}: {e}"
            assert (e.kind, e.code, e.peer) == ("data", 5, 1), (e.kind, e.code, e.peer, str(e))
            assert "rank 1 sent invalid aggregation data" in str(e) and what in str(e), str(e)
            # It stopped part-way: the session says so rather than running on.
            with pytest.raises(gradwire.UnusableError):
                s.barrier()
        finally:
            close_bounded([s])
        assert peer.finish(timeout=JOIN) == 0, peer.stderr()


# --- packaging: the stubs and the wheel ------------------------------------------------------


def _stub_signature(fn: Any) -> List[tuple]:
    """(name, kind, default) of a stub function's parameters, `self`/`cls` left out."""
    import ast

    a = fn.args
    out: List[tuple] = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(pos, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, None if d is None else ast.literal_eval(d)))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", None if d is None else ast.literal_eval(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out[1:] if out and out[0][0] in ("self", "cls") else out


def _runtime_signature(obj: Any) -> List[tuple] | None:
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # not introspectable (no __text_signature__)
    out = [
        (p.name, p.kind.name, None if p.default is inspect.Parameter.empty else p.default)
        for p in sig.parameters.values()
    ]
    return out[1:] if out and out[0][0] in ("self", "cls") else out


def test_the_stubs_match_the_native_module() -> None:
    """What mypy's stubtest checks, without mypy: every name in _native.pyi exists in the
    module (classes, their methods and properties, module attributes), with the same
    parameters (names, kinds, defaults) wherever the module's signature is introspectable;
    and every public name of the module and of its classes is in the stub. The stub's type
    aliases (plain assignments such as ``ArrayLike = Any``) exist for type checkers only."""
    import ast
    import inspect

    native = gradwire._native
    tree = ast.parse((REPO / "python" / "gradwire" / "_native.pyi").read_text())
    problems: List[str] = []
    stub_names = set()
    checked = 0

    def compare(where: str, stub_fn: Any, runtime: Any) -> None:
        nonlocal checked
        got = _runtime_signature(runtime)
        if got is None:
            return
        checked += 1
        want = _stub_signature(stub_fn)
        if got != want:
            problems.append(f"{where}: stub {want} != module {got}")

    for node in tree.body:
        if isinstance(node, ast.Assign):  # a type alias
            stub_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            continue
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            stub_names.add(name)
            if not hasattr(native, name):
                problems.append(f"{name}: in the stub, not in the module")
        elif isinstance(node, ast.FunctionDef):
            stub_names.add(node.name)
            if not hasattr(native, node.name):
                problems.append(f"{node.name}(): in the stub, not in the module")
            else:
                compare(node.name, node, getattr(native, node.name))
        elif isinstance(node, ast.ClassDef):
            stub_names.add(node.name)
            cls = getattr(native, node.name, None)
            if cls is None:
                problems.append(f"class {node.name}: in the stub, not in the module")
                continue
            members = set()
            for m in node.body:
                if not isinstance(m, ast.FunctionDef):
                    continue
                members.add(m.name)
                if m.name not in cls.__dict__ and not hasattr(cls, m.name):
                    problems.append(f"{node.name}.{m.name}: in the stub, not in the module")
                    continue
                is_prop = any(isinstance(d, ast.Name) and d.id == "property" for d in m.decorator_list)
                raw = inspect.getattr_static(cls, m.name)
                if is_prop != (inspect.isdatadescriptor(raw) and not callable(raw)):
                    problems.append(f"{node.name}.{m.name}: a property in one, not in the other")
                elif m.name == "__init__":
                    compare(f"{node.name}()", m, cls)
                elif not is_prop:
                    compare(f"{node.name}.{m.name}", m, getattr(cls, m.name))
            public = {n for n in cls.__dict__ if not n.startswith("_")}
            for n in sorted(public - members):
                problems.append(f"{node.name}.{n}: in the module, not in the stub")
    for n in sorted(n for n in dir(native) if not n.startswith("_")):
        if n not in stub_names:
            problems.append(f"{n}: in the module, not in the stub")
    if "__version__" not in stub_names:
        problems.append("__version__: not in the stub")
    assert not problems, "\n".join(problems)
    assert checked >= 10, f"only {checked} signatures were introspectable: the check checks nothing"


def _oldest_python(minor: int) -> str | None:
    """An interpreter of CPython 3.<minor>: GRADWIRE_PYTHON_OLDEST, python3.<minor> on PATH,
    or pyenv's."""
    import glob
    import shutil

    cands = [os.environ.get("GRADWIRE_PYTHON_OLDEST"), shutil.which(f"python3.{minor}")]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    cands += sorted(glob.glob(f"{root}/versions/3.{minor}.*/bin/python3"))
    for c in cands:
        if not c:
            continue
        v = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=60)
        if v.returncode == 0 and v.stdout.strip() == f"(3, {minor})":
            return c
    return None


def test_the_wheel_is_abi3_for_the_oldest_python_it_declares_and_imports_there(tmp_path: Any) -> None:
    """pyproject.toml's requires-python, the wheel's tag (cpXY-abi3) and the code must agree:
    the wheel is built as users build it, its tag and metadata are checked against
    requires-python's minimum, and on that CPython the native module initialises from the
    wheel and every Python file of the package compiles."""
    import re
    import zipfile

    pyproject = (REPO / "python" / "pyproject.toml").read_text()
    m = re.search(r'^requires-python\s*=\s*">=\s*3\.(\d+)"', pyproject, re.M)
    assert m, "requires-python must be a plain '>=3.N'"
    minor = int(m.group(1))
    out = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "--locked",
         "-m", str(REPO / "python" / "Cargo.toml"), "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
        env=dict(os.environ, CARGO_TARGET_DIR=os.environ.get("CARGO_TARGET_DIR", str(REPO / "target"))),
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = out.glob("gradwire-*.whl")
    assert f"-cp3{minor}-abi3-" in wheel.name, (wheel.name, f"requires-python >=3.{minor}")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        tags = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        z.extractall(tmp_path / "site")
    assert f"Requires-Python: >=3.{minor}" in meta, meta
    assert re.search(rf"^Tag: cp3{minor}-abi3-", tags, re.M), tags
    (native,) = [n for n in names if re.match(r"gradwire/_native\..*so$", n)]

    py = _oldest_python(minor)
    if py is None:
        what = f"no CPython 3.{minor} (set GRADWIRE_PYTHON_OLDEST)"
        if os.environ.get("GRADWIRE_REQUIRE_PRIV") == "1":
            pytest.fail(f"{what}; GRADWIRE_REQUIRE_PRIV=1 forbids skipping")
        pytest.skip(f"SKIPPED: {what}")
    # The native module's init on that interpreter (abi3 must mean it: no newer C API), loaded
    # on its own (the package's __init__ needs numpy, which that interpreter may not have),
    # and every .py file compiled by it (syntax newer than 3.<minor> fails here).
    site = tmp_path / "site"
    code = (
        "import importlib.machinery as m, importlib.util as u, sys, compileall\n"
        f"spec = u.spec_from_file_location('gradwire._native', {str(site / native)!r})\n"
        "mod = u.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "assert mod.__version__ and mod.Session and mod.ERROR_KINDS, dir(mod)\n"
        f"ok = compileall.compile_dir({str(site / 'gradwire')!r}, quiet=1, force=True)\n"
        "sys.exit(0 if ok else 3)\n"
    )
    run = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (py, run.stdout[-3000:], run.stderr[-3000:])


def test_add_note_works_without_exception_add_note() -> None:
    # Python < 3.11 has no BaseException.add_note: ddp's notes must still be attached.
    needs_torch()  # gradwire.ddp imports it
    from gradwire.ddp import _add_note

    class Old(Exception):
        add_note = property()  # hasattr() is False: as on 3.9 and 3.10

        def __getattribute__(self, name: str) -> Any:
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    e = Old("x")
    _add_note(e, "first")
    _add_note(e, "second")
    assert e.__notes__ == ["first", "second"]
    n = RuntimeError("y")
    _add_note(n, "third")
    assert n.__notes__ == ["third"]


def test_started_operations_run_together_and_free_their_memory() -> None:
    s0, s1 = connect(2)
    try:
        n = 50_000
        a = [np.full(n, float(r + 1), dtype=np.float32) for r in range(2)]
        b = [np.full(n, float(10 * (r + 1)), dtype=np.float32) for r in range(2)]
        w = [(s.start_all_reduce(a[r]), s.start_all_reduce(b[r], op="max")) for r, s in enumerate([s0, s1])]
        # The memory is claimed while the operation may run: a second use is refused.
        if not w[0][0].is_completed():
            with pytest.raises(gradwire.ConfigError, match="in use"):
                s0.start_all_reduce(a[0])
        for wa, wb in w:
            rep = wa.wait(timeout=30)
            assert rep.elems == n and rep.complete_blocks == rep.blocks
            assert wb.wait() is wb.wait()  # the same report again
            assert wa.is_completed()
        assert all((x == 3.0).all() for x in a) and all((x == 20.0).all() for x in b)
        # A receive nobody sends to: wait(timeout) says it still runs; dropped, it is
        # cancelled (and the array is free again).
        buf = np.zeros(1000, dtype=np.uint8)
        pending = s1.start_recv(buf, 0, tensor=9)
        with pytest.raises(TimeoutError, match="still running"):
            pending.wait(timeout=0.2)
        gathered = np.zeros(2 * 2 * s0.block_bytes, dtype=np.uint8)
        assert s0.chunk(gathered.size, 1) == (2 * s0.block_bytes, 4 * s0.block_bytes)
        with pytest.raises(gradwire.ConfigError, match="uint8"):
            s0.start_all_gather(np.zeros(10, dtype=np.float32))
    finally:
        close_all([s0, s1])
