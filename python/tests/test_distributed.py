"""The "gradwire" torch.distributed backend (gradwire.distributed) against PyTorch's Gloo.

Every rank is a process on 127.0.0.1 with torchrun's environment; this file is also the
ranks' program (``python test_distributed.py SCENARIO --out FILE``). Each rank runs the
default group on gradwire and a second group on Gloo, and compares the two.

Exactness: the reduction inputs are small integers in floating point, so every order of
addition gives the same bits and results must equal Gloo's exactly at any world size. DDP
runs on two ranks, where an all-reduce is one addition (a + b = b + a): the trained
parameters must be bit-identical.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

if __name__ != "__main__":
    from conftest import explain, run_ok


def _init(timeout: float = 30.0, options=None):
    import gradwire.distributed as gwd

    dist.init_process_group(
        gwd.BACKEND, timeout=datetime.timedelta(seconds=timeout), pg_options=options
    )
    return dist.new_group(backend="gloo")


def _ints(shape, dtype, rank: int, salt: int = 0) -> "torch.Tensor":
    n = 1
    for s in shape:
        n *= s
    v = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 - 5
    return v.reshape(shape).to(dtype)


def scenario_ops(a) -> dict:
    import gradwire.distributed as gwd

    # With the ring's results checked (its 70,000-element all-reduces run the ring on 3
    # ranks): still exactly Gloo's.
    gloo = _init(options=gwd.Options(verify_results=True))
    import gradwire

    r, w = dist.get_rank(), dist.get_world_size()
    bad: list[str] = []

    def same(name, x, y):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            bad.append(f"{name}: {x.flatten()[:6].tolist()} vs {y.flatten()[:6].tolist()}")

    ops = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "product": dist.ReduceOp.PRODUCT,
    }
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (1, 777, 70_000):
            for name, op in ops.items():
                if name == "product" and n > 1000:
                    continue  # products of 3 values in -5..5 stay exact; large n adds nothing
                x = _ints((n,), dtype, r)
                y = x.clone()
                dist.all_reduce(x, op=op)
                if name == "avg":
                    # Gloo has no AVG: its sum, then torch's division
                    dist.all_reduce(y, group=gloo)
                    y = y / w
                else:
                    dist.all_reduce(y, op=op, group=gloo)
                same(f"all_reduce {name} {dtype} n={n}", x, y)
    # Integers and float64 (reduced after a gather) equal Gloo's too.
    for dtype in (torch.int32, torch.int64, torch.float64, torch.uint8):
        for name, op in ops.items():
            if name == "avg" or (dtype == torch.uint8 and name in ("sum", "product")):
                continue
            x = _ints((999,), torch.int64, r).to(dtype) if dtype != torch.uint8 else torch.arange(999, dtype=torch.uint8) + r
            y = x.clone()
            dist.all_reduce(x, op=op)
            dist.all_reduce(y, op=op, group=gloo)
            same(f"all_reduce {name} {dtype}", x, y)
    # A non-contiguous tensor is reduced in place as well.
    x = _ints((40, 30), torch.float32, r).t()
    y = x.contiguous()
    dist.all_reduce(x)
    dist.all_reduce(y, group=gloo)
    same("all_reduce of a transposed tensor", x.contiguous(), y)
    # Broadcast and all-gather move any dtype.
    for dtype in (torch.int64, torch.float32, torch.uint8, torch.bool):
        b = _ints((1001,), torch.int64, r).to(dtype)
        c = b.clone()
        dist.broadcast(b, src=1)
        dist.broadcast(c, src=1, group=gloo)
        same(f"broadcast {dtype}", b, c)
        outs = [torch.empty(333, dtype=dtype) for _ in range(w)]
        gouts = [torch.empty(333, dtype=dtype) for _ in range(w)]
        dist.all_gather(outs, _ints((333,), torch.int64, r).to(dtype))
        dist.all_gather(gouts, _ints((333,), torch.int64, r).to(dtype), group=gloo)
        for q in range(w):
            same(f"all_gather {dtype} from {q}", outs[q], gouts[q])
    o, go = torch.empty(w * 5000), torch.empty(w * 5000)
    dist.all_gather_into_tensor(o, _ints((5000,), torch.float32, r))
    dist.all_gather_into_tensor(go, _ints((5000,), torch.float32, r), group=gloo)
    same("all_gather_into_tensor", o, go)
    for n in (3, 4000):
        ins = [_ints((n,), torch.float32, r, salt=q) for q in range(w)]
        o, go = torch.empty(n), torch.empty(n)
        dist.reduce_scatter(o, ins)
        dist.reduce_scatter(go, [i.clone() for i in ins], group=gloo)
        same(f"reduce_scatter n={n}", o, go)
        whole = _ints((w * n,), torch.bfloat16, r)
        o, go = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(o, whole)
        # Gloo has no reduce_scatter_tensor: the same from a full all-reduce
        full = whole.float()
        dist.all_reduce(full, group=gloo)
        same(f"reduce_scatter_tensor n={n}", o, full[r * n : (r + 1) * n].to(torch.bfloat16))
    dist.barrier()
    # Asynchronous work: several all-reduces in flight, waited in any order, and futures.
    xs = [_ints((20_000 * (k + 1),), torch.float32, r, salt=k) for k in range(6)]
    ys = [x.clone() for x in xs]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for y in ys:
        dist.all_reduce(y, group=gloo)
    for k in reversed(range(6)):
        works[k].wait()
        same(f"async all_reduce {k}", xs[k], ys[k])
    fut = dist.all_reduce(torch.ones(10), async_op=True).get_future()
    got = fut.wait()
    if not (isinstance(got, list) and torch.equal(got[0], torch.full((10,), float(w)))):
        bad.append(f"future value {got!r}")
    bw = dist.broadcast(torch.full((5,), float(r)), src=0, async_op=True)
    bw.wait()
    # Point to point: a ring with tags, any dtype.
    nxt, prv = (r + 1) % w, (r - 1) % w
    for dtype in (torch.float32, torch.int32):
        got = torch.empty(12_345, dtype=dtype)
        sw = dist.isend(_ints((12_345,), torch.int64, r).to(dtype), nxt, tag=5)
        rw = dist.irecv(got, prv, tag=5)
        sw.wait()
        rw.wait()
        same(f"send/recv {dtype}", got, _ints((12_345,), torch.int64, prv).to(dtype))
    # Errors: clear, typed, and the group stays usable after them.
    errors = {}
    for name, call in {
        "bool_all_reduce": lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)),
        "meta_device": lambda: dist.all_reduce(torch.empty(3, device="meta")),
        "bitwise_op": lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
        "gather_sizes": lambda: dist.all_gather([torch.empty(2) for _ in range(w)], torch.ones(3)),
        "gather_into_size": lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3)),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[name] = [type(e).__name__, isinstance(e, gradwire.ConfigError), str(e)]
    x = torch.ones(100)
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((100,), float(w))):
        bad.append("the group after the errors")
    dist.barrier()
    dist.destroy_process_group()
    return {"bad": bad, "errors": errors}


class _Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 128)
        self.c = nn.Linear(128, 10)
        self.skip = nn.Linear(128, 128) if unused else None

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def scenario_ddp(a) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = _init()
    r = dist.get_rank()
    variants = {
        "plain": {},
        "bucket_view": {"gradient_as_bucket_view": True},
        "static_graph": {"static_graph": True},
        "unused": {"find_unused_parameters": True},
        "small_buckets": {"bucket_cap_mb": 0.05},
    }
    out = {}
    for name, kw in variants.items():
        models = []
        for group in (None, gloo):
            torch.manual_seed(1)
            net = _Net(unused=name == "unused")
            models.append(DDP(net, process_group=group, **kw))
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        for step in range(a.steps):
            g = torch.Generator().manual_seed(1000 * r + step)
            x = torch.randn(32, 64, generator=g)
            y = torch.randint(0, 10, (32,), generator=g)
            for m, o in zip(models, opts):
                o.zero_grad()
                if name == "plain" and step % 2 == 0:
                    # no_sync accumulation: one local micro-batch, then one synchronised
                    with m.no_sync():
                        nn.functional.cross_entropy(m(x[:16]), y[:16]).backward()
                    nn.functional.cross_entropy(m(x[16:]), y[16:]).backward()
                else:
                    nn.functional.cross_entropy(m(x), y).backward()
                o.step()
        diff = max(
            (p - q).abs().max().item()
            for p, q in zip(models[0].parameters(), models[1].parameters())
        )
        out[name] = diff
    dist.destroy_process_group()
    return {"max_diff": out}


def scenario_dead(a) -> dict:
    import gradwire

    _init(timeout=a.timeout)
    r = dist.get_rank()
    dist.barrier()
    if r == a.victim:
        sys.stdout.flush()
        os._exit(0)  # dies without a word
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100_000), async_op=True).wait()
        return {"raised": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {
            "raised": type(e).__name__,
            "gradwire": isinstance(e, gradwire.GradwireError),
            "peer": getattr(e, "peer", None),
            "message": str(e),
            "seconds": time.monotonic() - t0,
        }


def scenario_lossy(a) -> dict:
    import gradwire.distributed as gwd

    gloo = _init(options=gwd.Options(loss_bound=a.bound, inject_loss=a.inject, seed=7))
    r, w = dist.get_rank(), dist.get_world_size()
    sums = []
    for k in range(a.steps):
        x = torch.randn(300_000, generator=torch.Generator().manual_seed(r * 100 + k))
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        # every rank's result, through Gloo, must be the same bits
        outs = [torch.empty_like(x) for _ in range(w)]
        dist.all_gather(outs, x, group=gloo)
        sums.append(all(torch.equal(outs[0], o) for o in outs))
    with gwd.loss_bound(0.0):
        x = _ints((50_000,), torch.float32, r)
        y = x.clone()
        dist.all_reduce(x)
        dist.all_reduce(y, group=gloo)
        reliable = torch.equal(x, y)
    dist.destroy_process_group()
    return {"identical": sums, "reliable_inside_context": reliable}


def scenario_secret(a) -> dict:
    """An authenticated job: every operation on the message layer, every datagram sealed with
    its pair of ranks' key, the results Gloo's."""
    import gradwire.distributed as gwd

    gloo = _init(options=gwd.Options(secret=b"s" * 32))
    r, w = dist.get_rank(), dist.get_world_size()
    bad = []
    x = _ints((30_000,), torch.float32, r)
    y = x.clone()
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    dist.all_reduce(y, group=gloo)
    if not torch.equal(x, y):
        bad.append("all_reduce")
    b = torch.arange(100, dtype=torch.int64) * (r + 1)
    dist.broadcast(b, src=1)
    if not torch.equal(b, torch.arange(100, dtype=torch.int64) * 2):
        bad.append("broadcast int64")
    outs = [torch.empty(50, dtype=torch.int64) for _ in range(w)]
    dist.all_gather(outs, torch.full((50,), r, dtype=torch.int64))
    if not all(torch.equal(o, torch.full((50,), q, dtype=torch.int64)) for q, o in enumerate(outs)):
        bad.append("all_gather int64")
    dist.barrier()
    full = _ints((4 * w,), torch.float32, r)
    mine, theirs = torch.empty(4), torch.empty(4)
    dist.reduce_scatter_tensor(mine, full.clone())
    dist.reduce_scatter_tensor(theirs, full.clone(), group=gloo)
    if not torch.equal(mine, theirs):
        bad.append("reduce_scatter")
    counters = gwd.message_stats()[0]
    dist.destroy_process_group()
    return {"bad": bad, "counters": counters}


def scenario_fsdp(a) -> dict:
    """FSDP2 (fully_shard) on the CPU over gradwire and over Gloo: the same losses and
    parameters, bit for bit, on two ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    gloo = _init()
    r, w = dist.get_rank(), dist.get_world_size()
    runs = {}
    for name, group in (("gradwire", dist.group.WORLD), ("gloo", gloo)):
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for step in range(a.steps):
            g = torch.Generator().manual_seed(r * 10 + step)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        full = [p.full_tensor().detach().clone() for p in m.parameters()]
        runs[name] = (losses, full)
    same = runs["gradwire"][0] == runs["gloo"][0] and all(
        torch.equal(p, q) for p, q in zip(runs["gradwire"][1], runs["gloo"][1])
    )
    dist.destroy_process_group()
    return {"same": same, "losses": runs["gradwire"][0], "torch": torch.__version__}


def _worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["ops", "ddp", "dead", "lossy", "secret", "fsdp"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--bound", type=float, default=0.1)
    ap.add_argument("--inject", type=float, default=0.05)
    a = ap.parse_args(argv)
    fn = {
        "ops": scenario_ops,
        "ddp": scenario_ddp,
        "dead": scenario_dead,
        "lossy": scenario_lossy,
        "secret": scenario_secret,
        "fsdp": scenario_fsdp,
    }[a.scenario]
    Path(a.out).write_text(json.dumps(fn(a)))
    sys.stdout.flush()
    os._exit(0)  # a dead peer leaves a group whose teardown need not be waited for


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------

HERE = Path(__file__).resolve()


def _run_ok(job, scenario: str, world: int, timeout: float, *args: str):
    return run_ok(job, HERE, scenario, world, timeout, *args)


def test_every_operation_matches_gloo_exactly_on_3_ranks(job):
    for out in _run_ok(job, "ops", 3, 180):
        assert out["bad"] == [], out["bad"]
        errs = out["errors"]
        for name, e in errs.items():
            assert e is not None, f"{name} did not raise"
        # gradwire's own checks raise ConfigError naming what to do
        for name in ("bool_all_reduce", "meta_device", "bitwise_op", "gather_sizes", "gather_into_size"):
            assert errs[name][1], f"{name}: {errs[name]}"
        assert "t.float()" in errs["bool_all_reduce"][2]
        assert "CPU" in errs["meta_device"][2]
        assert "gloo" in errs["bitwise_op"][2]


def test_ddp_unchanged_is_bit_identical_to_gloo_on_2_ranks(job):
    for out in _run_ok(job, "ddp", 2, 240, "--steps", "6"):
        assert out["max_diff"] == {k: 0.0 for k in out["max_diff"]}, out["max_diff"]
        assert set(out["max_diff"]) == {"plain", "bucket_view", "static_graph", "unused", "small_buckets"}


def test_a_dead_rank_raises_from_wait_naming_it(job):
    results = job.run(HERE, ["dead", "--victim", "2", "--timeout", "5"], 3, 60, wait_for=[0, 1])
    for r in results[:2]:
        assert r.returncode == 0 and r.output is not None, explain(results)
        out = r.output
        assert out["raised"] is not None, "the all-reduce with a dead rank returned"
        assert out["gradwire"] and out["raised"] == "PeerError", out
        assert out["peer"] == 2, out
        assert out["seconds"] < 20, out


def test_bounded_loss_leaves_every_rank_with_the_same_values(job):
    outs = _run_ok(job, "lossy", 3, 180, "--steps", "5", "--bound", "0.1", "--inject", "0.05")
    for out in outs:
        assert out["identical"] == [True] * 5, out
        assert out["reliable_inside_context"], out


def test_an_authenticated_job_runs_every_operation_sealed(job):
    for out in _run_ok(job, "secret", 2, 120):
        assert out["bad"] == [], out
        c = out["counters"]
        assert c is not None and c["unauthenticated"] == 0 and c["replayed"] == 0, out


def test_fsdp2_on_the_cpu_matches_gloo_bit_for_bit(job):
    for out in _run_ok(job, "fsdp", 2, 180, "--steps", "3"):
        assert out["same"], out
