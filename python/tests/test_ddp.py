"""gradwire's DDP communication hook (gradwire.ddp) against PyTorch's own Gloo all-reduce.

Multi-rank tests start every rank as a process on 127.0.0.1 (Gloo and gradwire both on
loopback): this file is also the ranks' program (``python test_ddp.py SCENARIO ...``).

Exactness: DDP's default divides each gradient by the world size and sums with Gloo; the
hook averages with gradwire (sum, then divide by the contributors). Dividing by 2 or 4 is
exact in binary floating point, so the results differ only by the order of addition. With 2
ranks there is one addition (a + b = b + a): the results must be bit-identical. With 4 ranks
the two rings add in different orders; each result is within 3 roundings of the exact
average, so the two may differ by at most 6u * sum_i |g_i| / W per element (u = 2^-24, the
unit roundoff of float32), the tolerance the 4-rank test checks, element by element, against
the ranks' own gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

if __name__ != "__main__":
    from conftest import explain, run_ok

U = 2.0**-24  # unit roundoff of float32
STEPS = 4


def make_model(seed: int = 0) -> nn.Module:
    """Three linear layers, parameters that start and end inside transport blocks (~360
    float32 each). The first layer (64 KB, ~45 blocks) is large enough that a 10 % bound
    lets a ring transfer of half of it (~22 blocks) leave 2 blocks out."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 256, generator=g), torch.randint(0, 5, (8,), generator=g)


# --------------------------------------------------------------------------------------
# The ranks' program
# --------------------------------------------------------------------------------------


def _init_dist():
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    return dist, dist.get_rank(), dist.get_world_size()


def _local_grads(model: nn.Module, x, y) -> list[torch.Tensor]:
    """This rank's own gradients, without DDP: the terms of the average."""
    m = make_model()
    m.load_state_dict(model.state_dict())
    F.cross_entropy(m(x), y).backward()
    return [p.grad.detach().clone() for p in m.parameters()]


def _gather(dist, tensors: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """Every rank's copy of `tensors`: out[rank][i]."""
    flat = torch.cat([t.flatten() for t in tensors])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    out = []
    for part in parts:
        ts, off = [], 0
        for t in tensors:
            ts.append(part[off : off + t.numel()].view_as(t))
            off += t.numel()
        out.append(ts)
    return out


def scenario_exact(a) -> dict:
    """Per step, DDP+Gloo and DDP+gradwire (p = 0) from the same parameters on the same
    batch; then both trained side by side."""
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist, rank, world = _init_dist()
    A, B = make_model(), make_model()
    ddp_a, ddp_b = DDP(A), DDP(B)
    seen = []
    state = gwddp.GradwireState(
        ddp_b, loss_bound=0.0, timeout=20, on_report=lambda *r: seen.append(r), verify_results=a.verify
    )
    ddp_b.register_comm_hook(state, gwddp.allreduce_hook)
    names = [n for n, _ in A.named_parameters()]
    steps = []
    opt_a = torch.optim.SGD(A.parameters(), lr=0.1)
    for step in range(a.steps):
        x, y = batch(rank, step)
        terms = _gather(dist, _local_grads(A, x, y), world)
        B.load_state_dict(A.state_dict())
        for m, d in ((A, ddp_a), (B, ddp_b)):
            m.zero_grad(set_to_none=True)
            F.cross_entropy(d(x), y).backward()
        rec = []
        for i, (name, pa, pb) in enumerate(zip(names, A.parameters(), B.parameters())):
            bound = 6 * U * sum(t[i].abs() for t in terms) / world
            diff = (pa.grad - pb.grad).abs()
            rec.append(
                {
                    "name": name,
                    "bit_equal": bool(torch.equal(pa.grad, pb.grad)),
                    "max_abs_diff": float(diff.max()),
                    "within_bound": bool((diff <= bound).all()),
                    "max_abs": float(pa.grad.abs().max()),
                }
            )
        steps.append(rec)
        opt_a.step()
    # Side by side: each model its own all-reduce and optimizer, from the same start.
    B.load_state_dict(A.state_dict())
    opt_b = torch.optim.SGD(B.parameters(), lr=0.1)
    for step in range(a.steps):
        x, y = batch(rank, 100 + step)
        for m, d, o in ((A, ddp_a, opt_a), (B, ddp_b, opt_b)):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(d(x), y).backward()
            o.step()
    trained = [
        {"name": n, "bit_equal": bool(torch.equal(pa, pb)), "max_abs_diff": float((pa - pb).abs().max())}
        for n, pa, pb in zip(names, A.parameters(), B.parameters())
    ]
    return {
        "world": world,
        "steps": steps,
        "trained": trained,
        "iterations": state.iteration,
        "log": [list(r) for r in state.log],
        "callback": [list(r) for r in seen],
        "allreduce_calls": state.allreduce_calls,
        "layers": {n: i.layer for n, i in state.by_name.items()},
        "num_layers": state.num_layers,
    }


def scenario_loss(a) -> dict:
    """Injected loss, the first layer at p = 0.1 and the others reliable: per step, each
    parameter's recorded delivered fraction against its values."""
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist, rank, world = _init_dist()
    model = make_model()
    ddp = DDP(model)
    state = gwddp.GradwireState(
        ddp,
        loss_bound=0.0,
        loss_bounds={"0.*": a.bound},
        timeout=20,
        inject_loss=a.inject,
        seed=rank + 1,
        keep_contributors=True,
        check_every=1,
    )
    ddp.register_comm_hook(state, gwddp.allreduce_hook)
    names = [n for n, _ in model.named_parameters()]
    steps = []
    for step in range(a.steps):
        x, y = batch(rank, step)
        terms = _gather(dist, _local_grads(model, x, y), world)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        frac = {r.name: r.delivered_fraction for r in state.log if r.iteration == step}
        assert state.contributors_iteration == step, (state.contributors_iteration, step)
        rec = []
        for i, (name, p) in enumerate(zip(names, model.parameters())):
            stacked = torch.stack([t[i] for t in terms])
            exact = stacked.sum(0) / world
            rec.append(
                {
                    "name": name,
                    "bound": state.by_name[name].loss_bound,
                    "numel": p.numel(),
                    "delivered": frac.get(name),
                    "equal_to_average": bool(torch.equal(p.grad, exact)),
                    "in_hull": bool(((p.grad >= stacked.min(0).values) & (p.grad <= stacked.max(0).values)).all()),
                    **_check_contributors(p.grad, [t[i] for t in terms], state.contributors.get(name), world),
                }
            )
        steps.append(rec)
        # Keep the ranks' models identical, so the next step's terms are well defined.
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad.clone()
                dist.broadcast(g, 0)
                p -= 0.05 * g
    return {
        "world": world,
        "steps": steps,
        "bound": a.bound,
        "inject": a.inject,
        "replica_checks": state.replica_checks,
        "min_delivered": state.min_delivered_by_parameter(),
    }


def scenario_diverge(a) -> dict:
    """Rank 1's checksum is made wrong from step 1 on: every rank's replica check must fail
    the next backward pass with a DataError naming the iteration and rank 1."""
    import gradwire
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist, rank, world = _init_dist()
    ddp = DDP(make_model())
    state = gwddp.GradwireState(ddp, timeout=10, check_every=1)
    ddp.register_comm_hook(state, gwddp.allreduce_hook)
    honest = gwddp._checksum
    for step in range(4):
        if rank == 1 and step == 1:
            gwddp._checksum = lambda buf: honest(buf) + 1
        x, y = batch(rank, step)
        try:
            F.cross_entropy(ddp(x), y).backward()
        except BaseException as e:  # noqa: BLE001 -- reported to the test
            f = state.failed
            return {
                "step": step,
                "message": str(e),
                "failed": type(f).__name__,
                "is_data_error": isinstance(f, gradwire.DataError),
                "failed_message": str(f),
                "checks": state.replica_checks,
            }
    return {"step": None, "checks": state.replica_checks}


def _check_contributors(grad: torch.Tensor, terms: list[torch.Tensor], runs, world: int) -> dict:
    """Every element of `grad` against the average of the ranks' gradients (`terms`) over the
    contributors the hook's record (`runs`, from the all-reduce report) names for it: exactly
    that rank's gradient for one contributor; otherwise their average to within the rounding
    of a float32 sum in any order and one division (u * sum of the |terms| summed)."""
    out = {"runs_cover": False, "mismatches": [], "by_count": {}, "frac_from_runs": None}
    if runs is None:
        out["mismatches"].append("no contributor record")
        return out
    g = grad.detach().flatten()
    flat = [t.flatten() for t in terms]
    out["runs_cover"] = (
        bool(runs) and runs[0].start == 0 and runs[-1].end == g.numel()
        and all(x.end == y.start for x, y in zip(runs, runs[1:]))
        and all(r.start < r.end for r in runs)
    )
    by_count: dict[int, int] = {}
    for run in runs:
        sl = slice(run.start, run.end)
        k = len(run.ranks)
        by_count[k] = by_count.get(k, 0) + run.end - run.start
        if k == 0 or any(not 0 <= r < world for r in run.ranks):
            out["mismatches"].append(f"{run}: not a set of ranks of the job")
            continue
        got = g[sl]
        if k == 1:
            want = flat[run.ranks[0]][sl]
            ok = torch.equal(got, want)
            err = float((got - want).abs().max())
        else:
            sel = torch.stack([flat[r][sl].double() for r in run.ranks])
            want = sel.sum(0) / k
            tol = U * sel.abs().sum(0)
            ok = bool(((got.double() - want).abs() <= tol).all())
            err = float((got.double() - want).abs().max())
        if not ok:
            out["mismatches"].append(f"{run}: max |result - average of its contributors| = {err}")
    out["by_count"] = {str(k): n for k, n in sorted(by_count.items())}
    out["frac_from_runs"] = sum(k * n for k, n in by_count.items()) / (world * g.numel())
    return out


def scenario_dead(a) -> dict:
    """Rank `--victim` dies (os._exit) between its forward and backward pass at step
    `--die-at`; the others must fail with a gradwire error, within the timeout."""
    import gradwire
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist, rank, world = _init_dist()
    model = make_model()
    ddp = DDP(model)
    state = gwddp.GradwireState(ddp, loss_bound=0.01, timeout=a.timeout)
    ddp.register_comm_hook(state, gwddp.allreduce_hook)
    for step in range(a.die_at + 5):
        x, y = batch(rank, step)
        loss = F.cross_entropy(ddp(x), y)
        if rank == a.victim and step == a.die_at:
            if a.stall:
                time.sleep(3600)  # alive, sockets open, silent: the test kills it
            os._exit(17)
        t0 = time.monotonic()
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001 -- reported to the test as it is
            # torch raises a failed communication future as RuntimeError; the state keeps
            # gradwire's own error.
            f = state.failed
            return {
                "step": step,
                "elapsed_s": time.monotonic() - t0,
                "raised": type(e).__name__,
                "raised_message": str(e),
                "type": type(f).__name__,
                "module": type(f).__module__,
                "is_gradwire": isinstance(f, gradwire.GradwireError),
                "is_peer_error": isinstance(f, gradwire.PeerError),
                "peer": getattr(f, "peer", None),
                "message": str(f),
                "notes": list(getattr(f, "__notes__", [])),
            }
    return {"step": None, "type": None, "message": "no error"}


def _worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["exact", "loss", "dead", "diverge"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--bound", type=float, default=0.1)
    ap.add_argument("--inject", type=float, default=0.05)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--die-at", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--stall", action="store_true", help="the victim stops instead of dying")
    ap.add_argument("--verify", action="store_true", help="GradwireState(verify_results=True)")
    a = ap.parse_args(argv)
    result = {
        "exact": scenario_exact,
        "loss": scenario_loss,
        "dead": scenario_dead,
        "diverge": scenario_diverge,
    }[a.scenario](a)
    Path(a.out).write_text(json.dumps(result))
    # The dead scenario leaves a broken process group behind: do not wait on its teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------

HERE = Path(__file__).resolve()


def _run_ok(job, scenario: str, world: int, timeout: float, *args: str):
    return run_ok(job, HERE, scenario, world, timeout, *args)


def _check_telemetry(out: dict, iterations: int) -> None:
    names = [p["name"] for p in out["steps"][0]] if out["steps"] else []
    assert out["iterations"] == iterations
    # One record per parameter and iteration, in the log and through the callback alike.
    assert len(out["log"]) == iterations * len(names)
    assert sorted(map(tuple, out["log"])) == sorted(map(tuple, out["callback"]))
    for it in range(iterations):
        assert sorted(r[1] for r in out["log"] if r[0] == it) == sorted(names)
    assert all(r[2] == 1.0 for r in out["log"]), "p = 0 delivers everything"


def test_p0_is_bit_exact_with_gloo_on_2_ranks(job):
    outs = _run_ok(job, "exact", 2, 120)
    for out in outs:
        for step in out["steps"]:
            for p in step:
                assert p["bit_equal"], f"step gradient of {p['name']} differs: {p}"
        for p in out["trained"]:
            assert p["bit_equal"], f"after training side by side, {p['name']} differs: {p}"
        # Two all-reduce steps of training per phase, STEPS each.
        _check_telemetry(out, 2 * STEPS)
        # Layers 0, 1, 2 of 3 are priorities 0, 2, 4: three all-reduces an iteration.
        assert out["num_layers"] == 3
        assert out["layers"] == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1, "4.weight": 2, "4.bias": 2}
        assert out["allreduce_calls"] == 3 * 2 * STEPS


def test_p0_matches_gloo_within_rounding_on_4_ranks(job):
    # With the results checked too (verify_results: ring chunks against their owners'
    # digests; the check itself is tested in Rust and test_native).
    outs = _run_ok(job, "exact", 4, 180, "--verify")
    exact = 0
    for out in outs:
        for step in out["steps"]:
            for p in step:
                assert p["within_bound"], f"{p['name']}: beyond 6u*sum|g|/W: {p}"
                exact += p["bit_equal"]
        # Trajectories: rounding-level differences may grow a little over 4 SGD steps.
        for p in out["trained"]:
            assert p["max_abs_diff"] <= 1e-6, p
        _check_telemetry(out, 2 * STEPS)
    # Most gradients still come out bit-identical; report, do not require.
    print(f"4 ranks: {exact} of {sum(len(s) for o in outs for s in o['steps'])} step gradients bit-identical")


LOSS_ARGS = ("--bound", "0.1", "--inject", "0.05", "--steps", "8")  # 2 ranks, the first layer lossy


def test_injected_loss_reports_fractions_consistent_with_the_bound(job):
    world, bound = 2, 0.1
    outs = _run_ok(job, "loss", world, 180, *LOSS_ARGS)
    lossy_seen = []
    for out in outs:
        for step in out["steps"]:
            lossy = [p for p in step if p["bound"] > 0]
            assert [p["name"] for p in lossy] == ["0.weight", "0.bias"]
            for p in step:
                assert p["delivered"] is not None, p
                assert p["in_hull"], f"{p['name']} is not an average of the ranks' gradients: {p}"
                if p["bound"] == 0:
                    # Reliable despite the injected loss: exactly the average.
                    assert p["delivered"] == 1.0 and p["equal_to_average"], p
                else:
                    # The bound holds for each parameter on its own, in every iteration,
                    # although 0.weight and 0.bias share one all-reduce.
                    assert 1 - bound - 1e-9 <= p["delivered"] <= 1.0, p
                    if p["delivered"] == 1.0:
                        assert p["equal_to_average"], p
                    lossy_seen.append(p["delivered"])
    # The injected loss is within the bound, so not all of it is sent again: it shows.
    assert min(lossy_seen) < 1.0, lossy_seen
    # The state's per-parameter minimum is the lowest of its iterations.
    for out in outs:
        for name, low in out["min_delivered"].items():
            seen = [p["delivered"] for step in out["steps"] for p in step if p["name"] == name]
            assert low == pytest.approx(min(seen)) and low >= 1 - bound - 1e-9, (name, low, seen)
    # Every bucket of every step but the last was compared across the ranks: identical.
    for out in outs:
        assert out["replica_checks"] >= len(out["steps"]) - 1, out["replica_checks"]


def test_diverged_replicas_fail_loudly_on_every_rank(job):
    for out in _run_ok(job, "diverge", 2, 120):
        assert out["step"] == 2, out  # step 1's sums are compared when step 2 starts
        assert out["is_data_error"], out
        assert "iteration 1" in out["failed_message"] and "ranks [1]" in out["failed_message"], out
        assert "different averaged gradients" in out["message"], out
        assert out["checks"] >= 1, out


def test_injected_loss_averages_each_element_over_its_reported_contributors(job):
    """Every element of every parameter, lossy or not, is the average of the gradients of
    the ranks the all-reduce report names for its block (``keep_contributors``): one rank's gradient exactly where only one arrived, never divided by the
    world."""
    world = 2
    outs = _run_ok(job, "loss", world, 180, *LOSS_ARGS)
    by_count: dict[str, int] = {}  # elements checked, by their number of contributors
    for rank, out in enumerate(outs):
        for n, step in enumerate(out["steps"]):
            for p in step:
                where = f"rank {rank}, step {n}, {p['name']}"
                assert p["runs_cover"], f"{where}: the contributor record does not cover it: {p}"
                assert not p["mismatches"], f"{where}: {p['mismatches'][:5]}"
                # The recorded fraction is the same report, read per block.
                assert p["delivered"] == pytest.approx(p["frac_from_runs"], rel=1e-9), (where, p)
                if p["bound"] == 0:
                    assert p["by_count"] == {str(world): p["numel"]}, (where, p)
                for k, count in p["by_count"].items():
                    by_count[k] = by_count.get(k, 0) + count
    # Both cases were checked: elements of one rank's gradient alone, and full averages.
    assert set(by_count) == {"1", "2"}, by_count
    print(f"elements checked by number of contributors: {by_count}")


def _check_survivors(results, victim: int, timeout: float) -> None:
    survivors = [r for r in results if r.rank != victim]
    for r in survivors:
        assert r.returncode == 0 and r.output is not None, explain(results)
        o = r.output
        assert o["step"] == 3, o
        assert o["raised"] in ("PeerError", "RuntimeError"), o
        assert f"rank {o['peer']}" in o["raised_message"], o
        assert o["is_gradwire"] and o["is_peer_error"], f"not a gradwire.PeerError: {o}"
        assert o["module"] == "gradwire" and o["type"] == "PeerError", o
        # The peer it lost: the victim, or a survivor that failed (and exited) first.
        assert o["peer"] in {victim} | {s.rank for s in survivors} - {r.rank}, o
        assert f"rank {o['peer']}" in o["message"], o
        assert any("during DDP's all-reduce" in n for n in o["notes"]), o
        # Within the timeout (plus the time to notice), not a hang.
        assert o["elapsed_s"] <= timeout + 5, o
    # Somebody noticed the victim itself.
    assert victim in [r.output["peer"] for r in survivors], explain(results)


def test_dead_rank_fails_the_others_with_a_gradwire_error(job):
    timeout = 5.0
    results = job.run(HERE, ["dead", "--victim", "2", "--die-at", "3", "--timeout", str(timeout)], 3, 90)
    assert results[2].returncode == 17, explain(results)
    _check_survivors(results, 2, timeout)
    # Its connections closed: noticed at once, well before the timeout.
    assert min(r.output["elapsed_s"] for r in results[:2]) < timeout, explain(results)


def test_silent_rank_fails_the_others_within_the_timeout(job):
    timeout = 5.0
    results = job.run(
        HERE, ["dead", "--victim", "1", "--die-at", "3", "--stall", "--timeout", str(timeout)], 3, 60,
        wait_for=[0, 2],
    )
    # The victim sleeps until the job kills it; the others give up on their own.
    assert results[1].returncode is None, explain(results)
    _check_survivors(results, 1, timeout)


# -- wrong use, in this process (a world of one) ------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from conftest import reserve_port

    # Reserved while the group lives: torch's store binds it (SO_REUSEADDR), nobody else can.
    port = reserve_port()
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port.getsockname()[1]}", rank=0, world_size=1
        )
        try:
            yield dist
        finally:
            dist.destroy_process_group()
    finally:
        port.close()


class FakeBucket:
    """What DDP hands a hook: buffer(), parameters(), gradients(), index(), is_last()."""

    def __init__(self, params, buffer, grads=None):
        self._params, self._buffer = list(params), buffer
        self._grads = grads
        if grads is None:
            self._grads, off = [], 0
            for p in self._params:
                self._grads.append(buffer[off : off + p.numel()].view(p.shape))
                off += p.numel()

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


def _state(model, **kw):
    import gradwire.ddp as gwddp

    return gwddp.GradwireState(model, ip="127.0.0.1", timeout=5, **kw)


def test_hook_works_in_a_world_of_one(world_of_one):
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model)
    state = _state(ddp)
    ddp.register_comm_hook(state, gwddp.allreduce_hook)
    x, y = batch(0, 0)
    F.cross_entropy(ddp(x), y).backward()
    want = _local_grads(model, x, y)
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert state.iteration == 1 and len(state.log) == 6
    state.close()


def test_unregistered_parameter_is_a_config_error(world_of_one):
    import gradwire
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_a, ddp_b = DDP(make_model()), DDP(make_model())
    state = _state(ddp_a)  # built from another model
    ddp_b.register_comm_hook(state, gwddp.allreduce_hook)
    x, y = batch(0, 0)
    with pytest.raises(gradwire.ConfigError, match="not registered with this GradwireState"):
        F.cross_entropy(ddp_b(x), y).backward()
    state.close()


def test_dtype_mismatch_is_a_config_error(world_of_one):
    import gradwire
    import gradwire.ddp as gwddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    # A model gradwire cannot reduce, refused when the state is built.
    with pytest.raises(gradwire.ConfigError, match="torch.float64"):
        _state(DDP(make_model().double()))
    # A bucket whose gradients are not the dtype the parameters were registered with (the
    # model was converted after the state was built).
    model = make_model()
    state = _state(model)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    bucket = FakeBucket(params, torch.zeros(n, dtype=torch.float16))
    with pytest.raises(gradwire.ConfigError, match="registered as torch.float32 but its gradient is torch.float16"):
        gwddp.allreduce_hook(state, bucket)
    # A dtype gradwire does not reduce at all.
    with pytest.raises(gradwire.ConfigError, match="float64"):
        gwddp.allreduce_hook(state, FakeBucket(params, torch.zeros(n, dtype=torch.float64)))
    state.close()


def test_cuda_tensor_is_a_config_error(world_of_one):
    """No GPU here: a meta-device tensor (really not on the CPU) and a stand-in object whose
    is_cuda and device.type say cuda take the same check a CUDA bucket would."""
    import gradwire
    import gradwire.ddp as gwddp

    model = make_model()
    state = _state(model)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    meta = torch.empty(n, device="meta")
    with pytest.raises(gradwire.ConfigError, match="on meta: gradwire's DDP hook works on CPU tensors"):
        gwddp.allreduce_hook(state, FakeBucket(params, meta))

    class CudaStandIn:
        is_cuda = True
        dtype = torch.float32
        device = types.SimpleNamespace(type="cuda", index=0, __str__=lambda self: "cuda:0")

        def numel(self):
            return n

    with pytest.raises(gradwire.ConfigError, match="works on CPU tensors only"):
        gwddp.allreduce_hook(state, FakeBucket(params, CudaStandIn(), grads=[]))
    # A model whose parameters are not on the CPU is refused when the state is built.
    with pytest.raises(gradwire.ConfigError, match="meta"):
        _state(make_model().to("meta"))
    state.close()


def test_bad_options_are_clear_errors(world_of_one, monkeypatch):
    import gradwire
    import gradwire.ddp as gwddp

    model = make_model()
    with pytest.raises(gradwire.ConfigError, match=r"loss bound 1\.0 is not a fraction"):
        _state(model, loss_bound=1.0)
    with pytest.raises(gradwire.ConfigError, match=r"loss_bounds\['0.weight'\]"):
        _state(model, loss_bounds={"0.weight": -0.1})
    with pytest.raises(gradwire.ConfigError, match="match no trainable parameter"):
        _state(model, loss_bounds={"conv*": 0.1})
    with pytest.raises(gradwire.ConfigError, match="is not a layer index"):
        _state(model, layers={"0.*": -1})
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        _state(object())
    with pytest.raises(TypeError, match="must be a gradwire.ddp.GradwireState"):
        gwddp.allreduce_hook(object(), FakeBucket([], torch.zeros(0)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(gradwire.ConfigError, match="init_process_group"):
        _state(model)


def test_loss_bounds_and_layers_resolve_by_name_then_pattern(world_of_one):
    model = make_model()
    state = _state(
        model,
        loss_bound=0.01,
        loss_bounds={"0.weight": 0.2, "0.*": 0.1, "4.*": 0.0},
        layers={"4.*": 0},
    )
    b = {n: i.loss_bound for n, i in state.by_name.items()}
    assert b == {"0.weight": 0.2, "0.bias": 0.1, "2.weight": 0.01, "2.bias": 0.01, "4.weight": 0.0, "4.bias": 0.0}
    lay = {n: (i.layer, i.priority) for n, i in state.by_name.items()}
    assert lay == {
        "0.weight": (0, 0), "0.bias": (0, 0), "2.weight": (1, 2), "2.bias": (1, 2),
        "4.weight": (0, 0), "4.bias": (0, 0),
    }  # fmt: skip
    state.close()


def test_priority_classes_coalesce_fewer_groups(world_of_one):
    import gradwire

    model = make_model()
    params = list(model.parameters())
    bucket = FakeBucket(params, torch.zeros(sum(p.numel() for p in params)))
    # 3 layers over 7 classes: priorities 0, 2, 4, three all-reduces; over 2, layers 0-1 and 2;
    # over 1 class, one
    # tagged with the front layer's DSCP; without coalescing, one per parameter.
    for classes, coalesce, want in ((7, True, [0, 1, 2]), (2, True, [0, 2]), (1, True, [0]), (7, False, [0, 0, 1, 1, 2, 2])):
        state = _state(model, priority_classes=classes, coalesce=coalesce)
        assert [g.layer for g in state.groups(bucket)] == want, (classes, coalesce)
        state.close()
    # A bound splits a class: consecutive parameters share an all-reduce only with one bound.
    state = _state(model, priority_classes=1, loss_bounds={"2.bias": 0.1})
    assert [[i.name for i, _, _ in g.params] for g in state.groups(bucket)] == [
        ["0.weight", "0.bias", "2.weight"], ["2.bias"], ["4.weight", "4.bias"]
    ]
    state.close()
    with pytest.raises(gradwire.ConfigError, match="priority_classes 0 is not in 1..7"):
        _state(model, priority_classes=0)


def test_delivered_fractions_match_element_by_element():
    """An all-reduce's per-block report mapped to each parameter's elements, against
    counting element by element."""
    import random

    import gradwire.ddp as gwddp

    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 3000)
        be = rng.randint(1, 400)
        blocks = -(-n // be)
        report = types.SimpleNamespace(
            block_elems=be,
            block_delivered=[rng.choice([0.25, 0.5, 0.75, 1.0]) for _ in range(blocks)],
            delivered_fraction=0.0,
        )
        a = rng.randint(0, n - 1)
        b = rng.randint(a + 1, n)
        want = sum(report.block_delivered[i // be] for i in range(a, b)) / (b - a)
        got = gwddp._range_delivered(report, a, b)
        assert got == pytest.approx(want, rel=1e-12), (n, be, a, b)


def test_contributor_runs_match_element_by_element():
    """An all-reduce's per-block contributor sets mapped to a parameter's elements as runs,
    against looking each element up."""
    import random

    import gradwire.ddp as gwddp

    rng = random.Random(11)
    sets_pool = [[0], [1], [0, 1], [2], [0, 2], [1, 2], [0, 1, 2]]
    for _ in range(300):
        n = rng.randint(1, 3000)
        be = rng.randint(1, 400)
        blocks = -(-n // be)
        sets = [rng.choice(sets_pool) for _ in range(blocks)]
        a = rng.randint(0, n - 1)
        b = rng.randint(a + 1, n)
        runs = gwddp._runs(sets, be, a, b)
        got = [r.ranks for r in runs for _ in range(r.start, r.end)]
        want = [tuple(sets[i // be]) for i in range(a, b)]
        assert got == want, (n, be, a, b)
        # Runs in order, each a maximal stretch of one set.
        assert runs[0].start == 0 and runs[-1].end == b - a
        assert all(x.end == y.start and x.ranks != y.ranks for x, y in zip(runs, runs[1:]))
