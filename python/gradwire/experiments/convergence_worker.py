"""One rank of the convergence experiment, started by ``gradwire.experiments.convergence``
with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

It trains one of the workloads of ``gradwire.experiments.workloads`` (a small CNN on
scikit-learn's digits, or a character-level transformer on a shipped text) with PyTorch's
DDP: gradients averaged by Gloo (DDP's own all-reduce, no hook), by gradwire's hook with a
loss bound, or by ``init_process_group("gradwire")``. Every rank sees the same data order and
starts from the same weights, so variants differ only in how gradients are averaged. It
writes its figures to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradwire.experiments import workloads

# Iterations at the start of the run left out of the iteration-time mean: DDP rebuilds its
# buckets after the first one, and both transports open their connections and find their
# rate there.
WARMUP_ITERATIONS = 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", required=True, help="gloo, gradwire-pN (the hook) or backend-pN")
    ap.add_argument("--loss-bound", type=float, default=0.0, help="gradwire's bound p")
    ap.add_argument("--workload", default="digits", help=", ".join(workloads.WORKLOADS))
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per iteration")
    ap.add_argument("--lr", type=float, default=None, help="default: 0.1 (digits), 0.01 (charlm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="gradwire's peer timeout, s")
    ap.add_argument("--rate-bps", type=int, default=None, help="gradwire senders' line rate")
    ap.add_argument("--priority-classes", type=int, default=7, help="gradwire hook's coalescing classes")
    ap.add_argument("--out", required=True, help="this rank's JSON")
    a = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=max(a.timeout, 30.0))
    backend = a.variant.startswith("backend")
    if backend:
        # DDP unchanged on init_process_group("gradwire"), the bound set for the group.
        import gradwire.distributed as gwd

        opts = gwd.Options(loss_bound=a.loss_bound, rate_bps=a.rate_bps)
        dist.init_process_group(gwd.BACKEND, timeout=timeout, pg_options=opts)
        gloo = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", timeout=timeout)
        gloo = None

    work = workloads.make(a.workload, a.batch, a.seed, world)
    torch.manual_seed(a.seed)
    model = work.model()
    ddp = DDP(model)
    state = None
    if a.variant != "gloo" and not backend:
        import gradwire.ddp as gwddp

        state = gwddp.GradwireState(
            ddp,
            loss_bound=a.loss_bound,
            timeout=a.timeout,
            rate_bps=a.rate_bps,
            priority_classes=a.priority_classes,
        )
        ddp.register_comm_hook(state, gwddp.allreduce_hook)
    if a.workload == "charlm":
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr or 0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=a.lr or 0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.epochs)

    iters_per_epoch = work.iters_per_epoch
    iter_ms: list[float] = []
    acc_per_epoch: list[float] = []
    loss_per_epoch: list[float] = []
    epoch_end_s: list[float] = []
    started = time.perf_counter()
    for epoch in range(a.epochs):
        model.train()
        for x, y in work.epoch_batches(epoch, rank, world):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            work.loss(ddp(x), y).backward()
            opt.step()
            iter_ms.append((time.perf_counter() - t0) * 1e3)
        sched.step()
        epoch_end_s.append(time.perf_counter() - started)
        model.eval()
        acc, loss = work.evaluate(model)
        acc_per_epoch.append(acc)
        loss_per_epoch.append(loss)
        if rank == 0:
            print(
                f"[{a.variant}] epoch {epoch + 1}/{a.epochs}: held-out accuracy {acc:.4f}, loss "
                f"{loss:.4f}, iteration {statistics.fmean(iter_ms[-iters_per_epoch:]):.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    train_s = time.perf_counter() - started

    # Replica drift: the largest difference between any rank's parameters and rank 0's
    # (0 when every rank applied the same averaged gradients, as DDP assumes).
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=gloo)
    drift = max(float((g - gathered[0]).abs().max()) for g in gathered)

    result = {
        "rank": rank,
        "replica_drift": drift,
        "world": world,
        "variant": a.variant,
        "loss_bound": a.loss_bound if state is not None else None,
        "epochs": a.epochs,
        "iterations": len(iter_ms),
        "iters_per_epoch": iters_per_epoch,
        "workload": a.workload,
        "accuracy_per_epoch": acc_per_epoch,
        "loss_per_epoch": loss_per_epoch,
        "epoch_end_s": epoch_end_s,
        "iteration_ms": iter_ms,
        "warmup_iterations": WARMUP_ITERATIONS,
        "train_s": train_s,
        "cpu_s": time.process_time(),  # every thread of this process, gradwire's included
        "params": sum(p.numel() for p in model.parameters()),
    }
    if state is not None:
        numel = {n: info.numel for n, info in state.by_name.items()}
        per_param = state.delivered_by_parameter()
        weighted = sum(r.delivered_fraction * numel[r.name] for r in state.log)
        result.update(
            delivered_fraction_mean=weighted / sum(numel[r.name] for r in state.log),
            delivered_fraction_min=min(r.delivered_fraction for r in state.log),
            delivered_by_parameter=per_param,
            layers={n: info.layer for n, info in state.by_name.items()},
            allreduce_calls=state.allreduce_calls,
            allreduce_s=state.allreduce_seconds,
            log_records=len(state.log),
        )
    else:
        result.update(delivered_fraction_mean=1.0, delivered_fraction_min=1.0)  # TCP: all of it
    # Nobody leaves while a peer may still need it.
    dist.barrier()
    with open(a.out, "w") as f:
        json.dump(result, f)
    if state is not None:
        state.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The result is written and the group destroyed. Leave without the interpreter's
    # teardown: a Gloo worker under link loss was seen to abort there ("terminate called
    # without an active exception", a C++ thread object destroyed at exit) after it had
    # finished and written everything, which made a complete baseline run count as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
