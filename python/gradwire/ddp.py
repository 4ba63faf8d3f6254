"""DDP's gradient all-reduce over gradwire, with a loss bound per parameter (DLCP).

After the usual ``torch.distributed.init_process_group("gloo")`` and
``ddp = DistributedDataParallel(model)``, three lines::

    import gradwire.ddp as gwddp
    state = gwddp.GradwireState(ddp, loss_bound=0.01)
    ddp.register_comm_hook(state, gwddp.allreduce_hook)

Every rank builds its state at the same point (the constructor is a collective): it binds
this rank's gradwire sockets and exchanges the endpoints with
``torch.distributed.all_gather_object`` over the process group the job already has, so there
is no registry of gradwire's own. The rank and world size come from torch.distributed; this
rank's address from ``ip=``, ``GRADWIRE_IP``, or the local address that routes to
``MASTER_ADDR``.

Each bucket DDP hands over is cut into its parameters. Consecutive parameters with the same
loss bound and the same DLCP priority class (``priority_classes``, 7 by default: one per
data DSCP) are all-reduced as one slice of the bucket's buffer (in place, ``op="average"``:
each block is averaged over the ranks whose contribution arrived, never divided by the full
world when some are missing, DLCP Appendix A). The bound holds for every parameter on its
own, however many share a slice: the slice's all-reduce is given each parameter's element
range (``ranges=``), and the transport does without a lost packet only if every parameter
it carries can afford it, asking again for the rest; the collective also rotates where each
lossy message starts, so what a bound leaves out moves from iteration to iteration without
copying the bucket. Each parameter's delivered fraction is read from the report's per-block
figures over its own element range, and lands in ``state.log``, the ``on_report`` callback
and ``state.min_delivered_by_parameter()``. With ``keep_contributors=True`` the state also
keeps, for the latest iteration, which ranks are averaged in each run of each parameter's
elements (``state.contributors``): the record to check a lossy result by.

Layers: by default a parameter's layer is the position of the module that owns it among the
modules with trainable parameters, in registration order (the forward order of a
``Sequential``), so front layers get the more urgent DSCP, as in DLCP §3.2.2.

The hook starts each bucket's all-reduces and returns at once; gradwire's completion thread
completes the bucket's future, so communication overlaps the rest of the backward pass. A
failed peer makes ``loss.backward()`` raise the RuntimeError torch makes of a failed
communication future, its message carrying gradwire's (``PeerError: rank N ...``);
``state.failed`` holds the ``gradwire.PeerError`` itself (``peer``, ``kind``, a note naming
the parameters), and every later hook call raises it. On the flow transport (a session with
the message layer off) a bucket is reduced inside the hook and the PeerError propagates
unchanged.
"""

from __future__ import annotations

import collections
import fnmatch
import ipaddress
import math
import os
import socket
import threading
from typing import Callable, Iterable, Mapping, NamedTuple

import torch
import torch.distributed as dist

import gradwire
from gradwire._completion import Completer

__all__ = ["ContributorRun", "GradwireState", "LossRecord", "ParamInfo", "allreduce_hook"]

# gradwire-qos: data priorities 0..=6 (queue 7 is control). Parameters whose layers fall in
# the same priority get the same DSCP, so they may share one all-reduce.
_DATA_PRIORITIES = 7

# dtypes the transport reduces (numerically, f16 and bf16 are summed in f32).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Iterations between replica checks by default: one all-gather of 8 bytes a bucket.
_DEFAULT_CHECK_EVERY = 50

# Records kept in ``state.log`` by default: ~100 iterations of a 1000-parameter model.
_DEFAULT_LOG_SIZE = 100_000


class LossRecord(NamedTuple):
    """One parameter's loss telemetry of one iteration."""

    iteration: int
    name: str
    delivered_fraction: float


class ContributorRun(NamedTuple):
    """Elements ``start:end`` of a parameter's flattened gradient are the average of the
    gradients of ``ranks`` (ascending), as this rank's all-reduce report names them."""

    start: int
    end: int
    ranks: tuple[int, ...]


class ParamInfo(NamedTuple):
    """What the state knows about one trainable parameter."""

    index: int
    name: str
    layer: int
    loss_bound: float
    dtype: torch.dtype
    numel: int
    priority: int  # DLCP data priority (0 = most urgent), as gradwire-qos derives the DSCP
    group_class: int  # parameters of one class (and bound) may share an all-reduce


class _Group(NamedTuple):
    start: int
    end: int
    loss_bound: float
    layer: int
    params: tuple[tuple[ParamInfo, int, int], ...]  # (info, start, end) in bucket elements


def _config_error(msg: str) -> gradwire.ConfigError:
    return gradwire.ConfigError(msg)


def _module_of(model: torch.nn.Module | torch.nn.parallel.DistributedDataParallel):
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    if isinstance(model, torch.nn.Module):
        return model
    raise TypeError(
        "GradwireState needs the DistributedDataParallel wrapper (or its module), "
        f"not {type(model).__name__}"
    )


def _lookup(table: Mapping[str, object] | None, name: str, used: set[str]):
    """The value for parameter `name`: an exact key first, then the first matching pattern."""
    if not table:
        return None
    if name in table:
        used.add(name)
        return table[name]
    for pattern, value in table.items():
        if fnmatch.fnmatchcase(name, pattern):
            used.add(pattern)
            return value
    return None


def _check_bound(p: object, where: str) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise _config_error(f"{where}: loss bound {p!r} is not a fraction in [0, 1)")
    return float(p)


def local_ip_towards(host: str) -> str:
    """The local address this host uses to reach `host` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)
    except socket.gaierror as e:
        raise _config_error(
            f"cannot resolve MASTER_ADDR {host!r} ({e}); set GRADWIRE_IP to this rank's address"
        ) from e
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _this_rank_ip(ip: str | None) -> str:
    if ip is None:
        ip = os.environ.get("GRADWIRE_IP")
    if ip is None:
        master = os.environ.get("MASTER_ADDR")
        if not master:
            raise _config_error(
                "cannot tell this rank's address: MASTER_ADDR is not set (torchrun sets it); "
                "pass ip= or set GRADWIRE_IP"
            )
        ip = local_ip_towards(master)
    try:
        ipaddress.ip_address(ip)
    except ValueError as e:
        raise _config_error(f"this rank's address {ip!r} is not an IP address") from e
    return ip


class GradwireState:
    """The hook's state: this rank's gradwire session and every parameter's bound and layer.

    Arguments:
        ddp: the ``DistributedDataParallel`` wrapper (or the module it wraps).
        loss_bound: the bound of parameters ``loss_bounds`` does not name, in [0, 1); 0 is
            reliable (the result equals a lossless all-reduce).
        loss_bounds: ``{name or fnmatch pattern: p}``; an exact name wins, then the first
            matching pattern in the dict's order. A key that matches no parameter is an error.
        layers: ``{name or pattern: layer index}`` overriding the default layer order (0 =
            front, the most urgent DSCP).
        on_report: called as ``on_report(iteration, name, delivered_fraction)`` for every
            parameter of every iteration, from the backward pass.
        timeout: set-up deadline and longest wait for a peer, seconds.
        ip: this rank's address (default: ``GRADWIRE_IP``, or the one routing to MASTER_ADDR).
        rate_bps: the senders' line rate (default: gradwire's).
        inject_loss, seed: testing: drop this fraction of arriving data packets.
        secret: job secret (16+ bytes): every datagram sealed with its pair of ranks' key.
        coalesce: all-reduce consecutive parameters of a bucket with the same bound and
            priority class as one slice (False: one all-reduce per parameter).
        priority_classes: how many classes the layers spread over for coalescing, 1..7
            (default 7, gradwire-qos's data priorities: one class per DSCP). Fewer classes mean
            fewer, larger all-reduces; a group is tagged with the DSCP of its front-most layer.
        log_size: records ``state.log`` keeps (the newest).
        check_every: every this many iterations (0: never) each rank checksums the averaged
            gradients of every bucket, and the ranks compare their checksums at the start of
            the next iteration (an all-gather of 8 bytes a bucket): replicas must apply the
            same gradient at any bound. A mismatch fails that iteration's backward pass with
            ``gradwire.DataError`` naming the iteration, the bucket and the ranks
            (``state.replica_checks`` counts the checks passed). Message layer only.
        keep_contributors: keep ``state.contributors``, ``{name: [ContributorRun, ...]}`` of
            the latest iteration (``state.contributors_iteration``): which ranks each element
            of each parameter averages, from the report's per-block sets (costs a list per
            block; for tests and diagnosis).
        process_group: the group whose ranks take part (default: the world).
        verify_results: every rank checks each chunk that came round the ring against its
            owner's digest, sent directly (see ``Session.all_reduce``): a rank that changed a
            chunk it forwarded fails the backward pass with ``gradwire.DataError`` naming
            the ranks it came through. Costs a hash of every bucket. Message layer only.

    The constructor is a collective: every rank of the group must build its state.
    """

    def __init__(
        self,
        ddp,
        loss_bound: float = 0.0,
        *,
        loss_bounds: Mapping[str, float] | None = None,
        layers: Mapping[str, int] | None = None,
        on_report: Callable[[int, str, float], None] | None = None,
        timeout: float = 30.0,
        ip: str | None = None,
        rate_bps: int | None = None,
        inject_loss: float = 0.0,
        seed: int = 0,
        secret: bytes | None = None,
        job: int = 1,
        coalesce: bool = True,
        priority_classes: int = _DATA_PRIORITIES,
        log_size: int | None = _DEFAULT_LOG_SIZE,
        keep_contributors: bool = False,
        check_every: int = _DEFAULT_CHECK_EVERY,
        process_group=None,
        verify_results: bool = False,
    ) -> None:
        module = _module_of(ddp)
        default_bound = _check_bound(loss_bound, "loss_bound")
        if on_report is not None and not callable(on_report):
            raise TypeError("on_report must be callable(iteration, name, delivered_fraction)")
        if not dist.is_available() or not dist.is_initialized():
            raise _config_error(
                "torch.distributed is not initialised: call "
                'torch.distributed.init_process_group("gloo") before GradwireState'
            )

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise _config_error("the model has no trainable parameters")
        # Default layers: the owning modules in registration order.
        owner_index: dict[str, int] = {}
        default_layer = []
        for name, _ in named:
            owner = name.rpartition(".")[0]
            default_layer.append(owner_index.setdefault(owner, len(owner_index)))
        used_bounds: set[str] = set()
        used_layers: set[str] = set()
        bounds, layer_of = [], []
        for (name, _), dl in zip(named, default_layer):
            b = _lookup(loss_bounds, name, used_bounds)
            bounds.append(default_bound if b is None else _check_bound(b, f"loss_bounds[{name!r}]"))
            lay = _lookup(layers, name, used_layers)
            if lay is not None and (isinstance(lay, bool) or not isinstance(lay, int) or lay < 0):
                raise _config_error(f"layers[{name!r}]: {lay!r} is not a layer index >= 0")
            layer_of.append(dl if lay is None else lay)
        for table, used, what in ((loss_bounds, used_bounds, "loss_bounds"), (layers, used_layers, "layers")):
            unused = [k for k in (table or {}) if k not in used]
            if unused:
                raise _config_error(
                    f"{what}: {unused} match no trainable parameter; the names are "
                    f"{[n for n, _ in named][:8]}{' ...' if len(named) > 8 else ''}"
                )
        if isinstance(priority_classes, bool) or not isinstance(priority_classes, int) or not (
            1 <= priority_classes <= _DATA_PRIORITIES
        ):
            raise _config_error(
                f"priority_classes {priority_classes!r} is not in 1..{_DATA_PRIORITIES}"
            )
        self.num_layers = max(max(layer_of) + 1, len(owner_index))
        if self.num_layers > 0xFFFF:
            raise _config_error(f"{self.num_layers} layers: gradwire tags at most 65535")

        self.params: dict[int, ParamInfo] = {}
        self.by_name: dict[str, ParamInfo] = {}
        for i, ((name, p), lay, b) in enumerate(zip(named, layer_of, bounds)):
            if p.dtype not in _DTYPES:
                raise _config_error(
                    f"parameter {name!r} is {p.dtype}: gradwire reduces float32, float16 and "
                    "bfloat16 (convert the model, e.g. model.float())"
                )
            if p.device.type != "cpu":
                raise _config_error(
                    f"parameter {name!r} is on {p.device}: gradwire's DDP hook works on CPU "
                    "tensors; keep the model on the CPU (or use NCCL for GPUs)"
                )
            priority = lay * _DATA_PRIORITIES // self.num_layers
            group_class = lay * priority_classes // self.num_layers
            info = ParamInfo(i, name, lay, b, p.dtype, p.numel(), priority, group_class)
            self.params[id(p)] = info
            self.by_name[name] = info
        # Parameters are kept alive by the model; `id` is stable while they live, and the
        # hook also checks the tensor is the registered one.
        self._tensors = {id(p): p for _, p in named}

        self.coalesce = bool(coalesce)
        self.on_report = on_report
        self.log: collections.deque[LossRecord] = collections.deque(maxlen=log_size)
        self.keep_contributors = bool(keep_contributors)
        self.verify_results = bool(verify_results)
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise _config_error(f"check_every {check_every!r} is not a number of iterations >= 0")
        self.check_every = check_every
        self.replica_checks = 0
        # {(iteration, bucket index): checksum} of finished buckets, compared at the start of
        # the next iteration (started in the same order on every rank).
        self._checksums: dict[tuple[int, int], int] = {}
        self.contributors: dict[str, list[ContributorRun]] = {}
        self.contributors_iteration: int | None = None
        self.iteration = 0
        self.allreduce_calls = 0
        self.allreduce_seconds = 0.0
        self._groups: dict[tuple[int, ...], tuple[_Group, ...]] = {}
        self._lock = threading.Lock()
        self.failed: BaseException | None = None

        pg = process_group
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)
        self.ip = _this_rank_ip(ip)
        endpoint = gradwire.Endpoint(
            self.rank,
            self.world,
            self.ip,
            job=job,
            loss_bound=default_bound,
            timeout=float(timeout),
            secret=secret,
            inject_loss=inject_loss,
            seed=seed,
            point_to_point=False,  # DDP needs only the ring
            rate_bps=rate_bps,
        )
        table: list[bytes | None] = [None] * self.world
        dist.all_gather_object(table, endpoint.address, group=pg)
        missing = [r for r, a in enumerate(table) if not isinstance(a, (bytes, bytearray))]
        if missing:
            raise gradwire.SetupError(f"ranks {missing} sent no gradwire endpoint")
        self.session = endpoint.connect([bytes(a) for a in table])
        self._completer = Completer(f"gradwire-ddp{self.rank}")

    # -- the bucket -> groups map ---------------------------------------------------------

    def _info(self, p: torch.Tensor) -> ParamInfo:
        info = self.params.get(id(p))
        if info is None or self._tensors.get(id(p)) is not p:
            raise _config_error(
                f"a parameter of shape {tuple(p.shape)} in DDP's bucket is not registered "
                "with this GradwireState: build the state from the same "
                "DistributedDataParallel model the hook is registered on"
            )
        return info

    def groups(self, bucket) -> tuple[_Group, ...]:
        """The all-reduces of `bucket`: runs of its parameters with one bound and class."""
        params = list(bucket.parameters())
        key = tuple(id(p) for p in params)
        cached = self._groups.get(key)
        if cached is not None:
            return cached
        groups: list[_Group] = []
        run: list[tuple[ParamInfo, int, int]] = []
        off = 0

        def close():
            if run:
                front = min(info.layer for info, _, _ in run)  # its DSCP tags the group
                groups.append(_Group(run[0][1], run[-1][2], run[0][0].loss_bound, front, tuple(run)))

        for p in params:
            info = self._info(p)
            item = (info, off, off + info.numel)
            if run and self.coalesce and (
                run[-1][0].loss_bound == info.loss_bound and run[-1][0].group_class == info.group_class
            ):
                run.append(item)
            else:
                close()
                run = [item]
            off += info.numel
        close()
        self._groups[key] = tuple(groups)
        return self._groups[key]

    # -- one bucket -----------------------------------------------------------------------

    def _checked_bucket(self, bucket):
        """The bucket's buffer and parameter groups, checked against the registration."""
        buf = bucket.buffer()
        _check_tensor(buf, "DDP's bucket")
        groups = self.groups(bucket)
        grads = bucket.gradients()
        total = groups[-1].end if groups else 0
        if total != buf.numel():
            raise RuntimeError(
                f"gradwire: bucket {bucket.index()} holds {buf.numel()} elements but its "
                f"parameters {total}; this torch version lays buckets out differently"
            )
        es = buf.element_size()
        flat = [item for g in groups for item in g.params]
        for (info, start, _), grad in zip(flat, grads):
            if grad.dtype != info.dtype or buf.dtype != info.dtype:
                raise _config_error(
                    f"parameter {info.name!r} was registered as {info.dtype} but its "
                    f"gradient is {grad.dtype} (bucket {buf.dtype}): build the "
                    "GradwireState after converting the model"
                )
            if grad.data_ptr() != buf.data_ptr() + start * es:
                raise RuntimeError(
                    f"gradwire: the gradient of {info.name!r} is not at element {start} of "
                    "DDP's bucket buffer; this torch version lays buckets out differently"
                )
        return buf, groups

    def _usable(self) -> None:
        if self.failed is not None:
            raise gradwire.UnusableError(
                f"an earlier all-reduce failed ({self.failed}); the job cannot go on"
            )

    def _failed(self, e: BaseException, g: _Group, iteration: int) -> None:
        if isinstance(e, gradwire.GradwireError):
            self.failed = e
        names = [info.name for info, _, _ in g.params]
        _add_note(
            e,
            f"gradwire: during DDP's all-reduce of {names} at iteration {iteration} on rank "
            f"{self.rank}",
        )

    def _plan(self, groups, buf):
        """For each group: the view of the bucket it all-reduces in place."""
        return [(g, buf[g.start : g.end]) for g in groups]

    def _reduce_options(self, g: _Group) -> dict:
        o = {
            "op": "average",
            "loss_bound": g.loss_bound,
            "layer": g.layer,
            "num_layers": self.num_layers,
        }
        if self.verify_results:
            o["verify_results"] = True
        if g.loss_bound > 0 and len(g.params) > 1 and self.session.message_layer:
            # Every parameter held to the bound on its own, not the slice as a whole.
            o["ranges"] = [(a - g.start, b - g.start) for _, a, b in g.params]
        return o

    def _records(self, plan, reports, iteration: int) -> list:
        """Undoes the rotations and turns the reports into per-parameter records."""
        records = []
        for (g, _view), report in zip(plan, reports):
            self.allreduce_calls += 1
            self.allreduce_seconds += report.elapsed_s
            sets = report.block_contributors if self.keep_contributors else None
            if sets is not None and self.contributors_iteration != iteration:
                self.contributors = {}
                self.contributors_iteration = iteration
            for info, start, end in g.params:
                frac = _range_delivered(report, start - g.start, end - g.start)
                records.append(LossRecord(iteration, info.name, frac))
                if sets is not None:
                    self.contributors[info.name] = _runs(
                        sets, report.block_elems, start - g.start, end - g.start
                    )
        self.log.extend(records)
        return records

    def _report(self, iteration: int, records) -> None:
        if self.on_report is not None:
            for r in records:
                self.on_report(iteration, r.name, r.delivered_fraction)

    def start_bucket(self, bucket) -> torch.futures.Future:
        """Starts the all-reduces of `bucket` (one per group, all in flight together) and
        returns a future of its buffer that gradwire's completion thread completes, so
        communication overlaps the rest of the backward pass. On the flow transport (the
        message layer off) the bucket is reduced before this returns."""
        if not self.session.message_layer:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self.reduce_bucket(bucket))
            return fut
        buf, groups = self._checked_bucket(bucket)
        with self._lock:
            self._usable()
            iteration = self.iteration
            plan = self._plan(groups, buf)
            natives = []
            check = self._start_replica_check()
            if check is not None:
                natives.append(check[0])
            for g, view in plan:
                try:
                    natives.append(self.session.start_all_reduce(view, **self._reduce_options(g)))
                except gradwire.GradwireError as e:
                    self._failed(e, g, iteration)
                    raise
            if bucket.is_last():
                self.iteration += 1

        checks = self.check_every and iteration % self.check_every == 0
        index = bucket.index()

        def finish(reports):
            if check is not None:
                self._compare_replicas(check[1], check[2])
                reports = reports[1:]
            with self._lock:
                records = self._records(plan, reports, iteration)
                if checks:
                    self._checksums[(iteration, index)] = _checksum(buf)
            self._report(iteration, records)
            return buf

        def failed(e: BaseException) -> None:
            with self._lock:
                self._failed(e, plan[0][0] if len(plan) == 1 else _all_groups(plan), iteration)

        fut = torch.futures.Future()
        self._completer.add(natives, fut, finish, on_error=failed)
        # A Python future holds its error as a value that only Python's wait() raises; DDP
        # waits in C++. A callback that raises it marks the chained future failed, so
        # loss.backward() raises instead of DDP reading an exception as the bucket.
        return fut.then(_value)

    def _start_replica_check(self):
        """At an iteration's first bucket: starts the all-gather of the previous checked
        iteration's checksums (the same keys on every rank, in order). Returns the work,
        the keys and the staging buffer, or None."""
        if not self._checksums:
            return None
        keys = sorted(self._checksums)
        if keys[-1][0] >= self.iteration:
            return None  # this iteration's own buckets: compared at the next one
        mine = torch.tensor([self._checksums.pop(k) for k in keys], dtype=torch.int64)
        per = self._padded_bytes(mine.numel() * 8)
        staging = torch.zeros(per * self.world, dtype=torch.uint8)
        a, _ = self.session.chunk(staging.numel(), self.rank)
        staging[a : a + mine.numel() * 8] = mine.view(torch.uint8)
        return self.session.start_all_gather(staging.numpy()), keys, staging

    def _padded_bytes(self, n: int) -> int:
        bb = self.session.block_bytes
        return max(1, -(-n // bb)) * bb

    def _compare_replicas(self, keys, staging) -> None:
        n = len(keys) * 8
        sums = []
        for r in range(self.world):
            a, _ = self.session.chunk(staging.numel(), r)
            sums.append(staging[a : a + n].view(torch.int64).tolist())
        for i, (it, b) in enumerate(keys):
            values = [s[i] for s in sums]
            if len(set(values)) != 1:
                odd = [r for r, v in enumerate(values) if v != values[0]]
                err = gradwire.DataError(
                    f"gradwire: the ranks applied different averaged gradients at iteration {it} "
                    f"(DDP bucket {b}): checksums by rank {values}; ranks {odd} differ from "
                    "rank 0. The replicas have diverged: restart from a checkpoint and report "
                    "this as a bug"
                )
                self.failed = err
                raise err
        self.replica_checks += len(keys)

    def reduce_bucket(self, bucket) -> torch.Tensor:
        """All-reduce `bucket` in place, waiting for it, and record each parameter's
        delivered fraction."""
        buf, groups = self._checked_bucket(bucket)
        with self._lock:
            self._usable()
            iteration = self.iteration
            plan = self._plan(groups, buf)
            reports = []
            for g, view in plan:
                try:
                    reports.append(self.session.all_reduce(view, **self._reduce_options(g)))
                except gradwire.GradwireError as e:
                    self._failed(e, g, iteration)
                    raise
            records = self._records(plan, reports, iteration)
            if bucket.is_last():
                self.iteration += 1
        self._report(iteration, records)
        return buf

    # -- telemetry ------------------------------------------------------------------------

    def delivered_by_parameter(self, records: Iterable[LossRecord] | None = None) -> dict[str, float]:
        """Mean delivered fraction of each parameter over `records` (default: the log)."""
        sums: dict[str, list[float]] = {}
        for r in self.log if records is None else records:
            s = sums.setdefault(r.name, [0.0, 0])
            s[0] += r.delivered_fraction
            s[1] += 1
        return {n: s[0] / s[1] for n, s in sums.items()}

    def min_delivered_by_parameter(
        self, records: Iterable[LossRecord] | None = None
    ) -> dict[str, float]:
        """Lowest delivered fraction of each parameter in any one iteration of `records`
        (default: the log): at least ``1 - loss_bound`` for every parameter, however the
        parameters were coalesced."""
        low: dict[str, float] = {}
        for r in self.log if records is None else records:
            low[r.name] = min(low.get(r.name, 1.0), r.delivered_fraction)
        return low

    def close(self) -> None:
        """Close the gradwire session (the hook fails afterwards)."""
        self._completer.close()
        self.session.close()

    def __enter__(self) -> "GradwireState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GradwireState(rank={self.rank}, world={self.world}, ip={self.ip!r}, "
            f"params={len(self.params)}, layers={self.num_layers}, iteration={self.iteration})"
        )



def _checksum(buf: torch.Tensor) -> int:
    """A position-weighted sum of the buffer's bits: cheap, and any change to a few elements
    (or a permutation) changes it."""
    bits = buf.detach().reshape(-1).view(torch.int16 if buf.element_size() == 2 else torch.int32)
    w = torch.arange(1, bits.numel() + 1, dtype=torch.int64) % 65521
    return int((bits.to(torch.int64) * w).sum())


def _value(fut: torch.futures.Future):
    return fut.value()


def _all_groups(plan) -> _Group:
    """One pseudo-group naming every parameter of a bucket's plan (for error notes)."""
    params = tuple(p for g, *_ in plan for p in g.params)
    return _Group(plan[0][0].start, plan[-1][0].end, plan[0][0].loss_bound, plan[0][0].layer, params)


def _add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)`` (Python 3.11+), or the same ``__notes__`` list by hand on the
    older Pythons the package supports (>= 3.9), where tracebacks do not print it."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        e.__notes__ = [*getattr(e, "__notes__", []), note]


def _check_tensor(t, what: str) -> None:
    """A clear error for tensors gradwire cannot reduce in place."""
    device = getattr(t, "device", None)
    dev_type = getattr(device, "type", None)
    if getattr(t, "is_cuda", False) or dev_type not in (None, "cpu"):
        raise _config_error(
            f"{what} is on {device}: gradwire's DDP hook works on CPU tensors only; keep the "
            "model on the CPU, or use the NCCL backend for GPU training"
        )
    if t.dtype not in _DTYPES:
        raise _config_error(
            f"{what} is {t.dtype}: gradwire reduces float32, float16 and bfloat16"
        )


def _runs(sets: list[list[int]], be: int, start: int, end: int) -> list[ContributorRun]:
    """Elements [start, end) of a group (in blocks of `be` elements) as runs of one
    contributor set, counted from `start`."""
    runs: list[ContributorRun] = []
    i = start
    while i < end:
        b = i // be
        stop = min(end, (b + 1) * be)
        ranks = tuple(sets[b])
        if runs and runs[-1].ranks == ranks:
            runs[-1] = runs[-1]._replace(end=stop - start)
        else:
            runs.append(ContributorRun(i - start, stop - start, ranks))
        i = stop
    return runs


def _range_delivered(report, start: int, end: int) -> float:
    """Element-weighted mean of the report's per-block delivered fractions over [start, end)."""
    if end <= start:
        return 1.0
    be = report.block_elems
    blocks = report.block_delivered
    if be <= 0 or not blocks:
        return float(report.delivered_fraction)
    first, last = start // be, (end - 1) // be
    if first == last:
        return float(blocks[first])
    total = blocks[first] * ((first + 1) * be - start) + blocks[last] * (end - last * be)
    total += math.fsum(blocks[first + 1 : last]) * be
    return float(total / (end - start))


def allreduce_hook(state: GradwireState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients over gradwire, in place.

    Register with ``ddp.register_comm_hook(state, allreduce_hook)``. Starts the bucket's
    all-reduces and returns a future of the bucket's buffer that gradwire's completion thread
    completes: several buckets, and the priority classes of one bucket, are in flight
    together while the backward pass goes on.
    """
    if not isinstance(state, GradwireState):
        raise TypeError(
            "allreduce_hook's state must be a gradwire.ddp.GradwireState, not "
            f"{type(state).__name__}: ddp.register_comm_hook(GradwireState(ddp), allreduce_hook)"
        )
    return state.start_bucket(bucket)


# DDP checks the hook's return annotation by value; the postponed annotations of this module
# would hand it a string.
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
