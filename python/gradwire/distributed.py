"""gradwire as a torch.distributed backend: ``init_process_group("gradwire")``.

::

    import torch.distributed as dist
    import gradwire.distributed          # registers the "gradwire" backend
    dist.init_process_group("gradwire")  # under torchrun, or with MASTER_ADDR/MASTER_PORT

Then the usual calls work on CPU tensors, each with ``async_op=True`` returning work with
``wait()`` and ``get_future()``: ``all_reduce`` (sum, avg, min, max, product),
``broadcast``, ``all_gather``/``all_gather_into_tensor``,
``reduce_scatter``/``reduce_scatter_tensor``, ``barrier``, ``send``/``recv``.
``DistributedDataParallel`` works unchanged.

Reliable by default: results are what Gloo computes (bit for bit for sums on two ranks).
A loss bound (DLCP) is set for a whole process group with
``pg_options=gradwire.distributed.Options(loss_bound=0.01)``, or for the calls made inside
``with gradwire.distributed.loss_bound(0.01):`` in this thread; it applies to sum and
average reductions and broadcasts (min, max and product are reliable only; gathers, barriers
and point-to-point transfers move data reliably). Under a bound the reduce half is bounded
and the result half reliable, so every rank ends with the same values.

Set-up: each rank binds its gradwire socket on ``Options.ip``, ``GRADWIRE_IP``, or the local
address that routes to ``MASTER_ADDR``, and the ranks exchange endpoints through the store
torch.distributed gives the backend (no port of gradwire's own to open). Operations run
on gradwire's progress thread; one completion thread per group turns their outcomes into
the futures torch waits on. A dead or silent rank fails the operation, and every later one,
with ``gradwire.PeerError`` naming it, raised from ``wait()``.

Reductions take float32, float16 and bfloat16 (integers and float64 are reduced exactly after
a reliable all-gather, for the small bookkeeping tensors DDP reduces); data movement takes
any dtype. Tensors must be on the CPU. With a job secret (``Options(secret=...)``) every datagram is
sealed with the key of its pair of ranks, so no stranger and no other member can speak as a rank.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import secrets as _secrets
import threading
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

import gradwire
from gradwire._completion import Completer

__all__ = ["BACKEND", "Options", "ProcessGroupGradwire", "loss_bound"]

#: The name to give ``init_process_group``.
BACKEND = "gradwire"

_REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Reduced reliably through an all-gather (exact, in rank order): DDP's bookkeeping tensors.
_GATHER_REDUCE_DTYPES = (
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
)

_local = threading.local()


class Options:
    """A gradwire process group's options (``init_process_group(..., pg_options=...)``).

    ``loss_bound``: DLCP's bound for sum/average reductions and broadcasts (0: reliable).
    ``ip``: this rank's address (default: ``GRADWIRE_IP``, else the local address towards
    ``MASTER_ADDR``). ``secret``: a job secret (bytes) every rank shares: every datagram
    sealed with its pair of ranks' key. ``rate_bps``: a sending rate cap. ``inject_loss``: drop
    this fraction of incoming data packets (tests and experiments). ``mtu``: the network's
    MTU, the same on every rank (default 1500; 9000 with jumbo frames; up to 65535 for a
    one-host job on loopback). ``verify_results``: all-reduces check every chunk that came
    round the ring against its owner's digest, sent directly (a changed one raises
    ``gradwire.DataError`` naming the ranks it came through; message layer only)."""

    def __init__(
        self,
        *,
        loss_bound: float = 0.0,
        ip: Optional[str] = None,
        secret: Optional[bytes] = None,
        rate_bps: Optional[int] = None,
        inject_loss: float = 0.0,
        seed: int = 0,
        mtu: Optional[int] = None,
        verify_results: bool = False,
    ) -> None:
        if isinstance(loss_bound, bool) or not 0.0 <= float(loss_bound) < 1.0:
            raise gradwire.ConfigError(f"loss_bound {loss_bound!r} is not a fraction in [0, 1)")
        self.loss_bound = float(loss_bound)
        self.ip = ip
        self.secret = secret
        self.rate_bps = rate_bps
        self.inject_loss = inject_loss
        self.seed = seed
        self.mtu = mtu
        self.verify_results = bool(verify_results)


@contextlib.contextmanager
def loss_bound(p: float) -> Iterator[None]:
    """Sum/average reductions and broadcasts started by this thread inside the block use
    loss bound ``p`` (instead of the group's)."""
    if isinstance(p, bool) or not 0.0 <= float(p) < 1.0:
        raise gradwire.ConfigError(f"loss bound {p!r} is not a fraction in [0, 1)")
    saved = getattr(_local, "bound", None)
    _local.bound = float(p)
    try:
        yield
    finally:
        _local.bound = saved


def _local_ip() -> str:
    ip = os.environ.get("GRADWIRE_IP")
    if ip:
        return ip
    master = os.environ.get("MASTER_ADDR")
    if not master:
        raise gradwire.ConfigError(
            "gradwire cannot tell this rank's address: set GRADWIRE_IP (or MASTER_ADDR, and "
            "the address that routes there is used), or pass Options(ip=...)"
        )
    from gradwire.ddp import local_ip_towards

    return local_ip_towards(master)


def _bytes_of(t: torch.Tensor, what: str, writes: bool) -> Any:
    """The tensor's memory as a numpy uint8 array (any dtype), for data movement."""
    _check_cpu(t, what)
    if not t.is_contiguous():
        raise gradwire.ConfigError(
            f"{what}: the tensor is not contiguous: pass t.contiguous() (and use the result)"
        )
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


def _check_cpu(t: Any, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise gradwire.ConfigError(f"{what}: expected a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise gradwire.ConfigError(
            f"{what}: gradwire moves CPU tensors, and this one is on {t.device}: copy it with "
            ".cpu() (or use NCCL for GPU tensors, e.g. init_process_group('cpu:gradwire,"
            "cuda:nccl'))"
        )
    if t.layout != torch.strided:
        raise gradwire.ConfigError(f"{what}: dense tensors only, not {t.layout}: .to_dense()")


def _check_float(t: torch.Tensor, what: str) -> None:
    _check_cpu(t, what)
    if t.dtype not in _REDUCE_DTYPES:
        raise gradwire.ConfigError(
            f"{what}: gradwire reduces float32, float16 and bfloat16 tensors (integers and "
            f"float64 through a gather), not {t.dtype}: convert with t.float() (and back), or "
            "reduce it with the gloo backend"
        )


# torch's reductions gradwire runs, and their names in gradwire (built once: every
# all_reduce looks its op up here).
_OPS = (
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "average"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.PRODUCT, "product"),
)


def _op_name(op: Any) -> str:
    for k, v in _OPS:
        if op == k:
            return v
    raise gradwire.ConfigError(
        f"gradwire reduces with SUM, AVG, MIN, MAX and PRODUCT, not {op}: for bitwise ops use "
        "the gloo backend"
    )


class _Work(dist._Work):
    """torch's work over a future the completion thread completes: ``wait()`` raises the
    operation's error (torch's own future-backed work would swallow it), ``get_future()``
    is what DDP chains on."""

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()  # raises the operation's error
        return True

    def get_future(self) -> Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self) -> Optional[BaseException]:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None


class ProcessGroupGradwire(dist.ProcessGroup):
    """A torch.distributed process group over one gradwire session (see the module doc)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        timeout: datetime.timedelta,
        options: Optional[Options] = None,
    ) -> None:
        super().__init__(rank, world)
        self._rank = rank
        self._world = world
        self._opts = options or Options()
        seconds = max(1.0, timeout.total_seconds()) if timeout else 300.0
        # Every rank of the group must name the same job: rank 0 draws it (so a stray packet
        # of another job, or of an earlier group on the same ports, is refused).
        if rank == 0:
            store.set("gradwire/job", str(_secrets.randbelow(1 << 31) + 1))
        job = int(store.get("gradwire/job"))
        endpoint = gradwire.Endpoint(
            rank,
            world,
            self._opts.ip or _local_ip(),
            job=job,
            loss_bound=self._opts.loss_bound,
            timeout=seconds,
            secret=self._opts.secret,
            inject_loss=self._opts.inject_loss,
            seed=self._opts.seed,
            rate_bps=self._opts.rate_bps,
            mtu=self._opts.mtu,
        )
        store.set(f"gradwire/endpoint/{rank}", endpoint.address)
        table = [bytes(store.get(f"gradwire/endpoint/{r}")) for r in range(world)]
        self._session = endpoint.connect(table)
        self._async = self._session.message_layer
        self._block = self._session.block_bytes if self._async else 0
        self._completer = Completer(f"gradwire-pg{rank}")
        _groups.append(weakref.ref(self))

    # -- plumbing -------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # torch names groups after creating them (DeviceMesh and FSDP look them up by name).
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return getattr(self, "_group_desc", "")

    def __repr__(self) -> str:
        return f"ProcessGroupGradwire(rank={self._rank}, world={self._world})"

    def _bound(self) -> Optional[float]:
        return getattr(_local, "bound", None)

    def _work(
        self,
        start: Callable[[], Any],
        finish: Callable[[Any], Any],
        blocking: Callable[[], Any],
    ) -> Any:
        """Starts an operation (or, on the flow transport, runs it) and returns torch's work
        over a future the completion thread completes with ``finish(report)``."""
        fut: Future = Future()
        if self._async:
            native = start()
            self._completer.add([native], fut, lambda reports: finish(reports[0]))
        else:
            try:
                fut.set_result(finish(blocking()))
            except BaseException as e:  # noqa: BLE001 - raised from wait(), as async errors are
                fut.set_exception(e)
        return _Work(fut)

    def _done(self, value: Any) -> Any:
        fut: Future = Future()
        fut.set_result(value)
        return _Work(fut)

    def _padded(self, nbytes: int) -> int:
        """Bytes per rank's chunk of a gather/scatter staging buffer: whole blocks."""
        return max(1, math.ceil(nbytes / self._block)) * self._block

    # -- collectives ----------------------------------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        outs = []
        for t in tensors:
            if t.dtype in _GATHER_REDUCE_DTYPES:
                outs.append(self._allreduce_gathered(t, op))
                continue
            _check_float(t, "all_reduce")
            outs.append(self._allreduce_one(t, op))
        if len(outs) == 1:
            return outs[0]
        futs = [w.get_future() for w in outs]
        all_fut = torch.futures.collect_all(futs).then(lambda _: tensors)
        return _Work(all_fut)

    def _allreduce_one(
        self, t: torch.Tensor, op: str, after: Optional[Callable[[], Any]] = None
    ) -> Any:
        if t.numel() == 0:
            return self._done(after() if after else [t])
        work_t = t if t.is_contiguous() else t.contiguous()
        bound = self._bound() if op in ("sum", "average") else 0.0
        kw = {"op": op, "loss_bound": bound}
        if self._opts.verify_results:
            kw["verify_results"] = True

        def finish(_report: Any) -> Any:
            if work_t is not t:
                t.copy_(work_t)
            return after() if after else [t]

        return self._work(
            lambda: self._session.start_all_reduce(work_t, **kw),
            finish,
            lambda: self._session.all_reduce(work_t, **kw),
        )

    def _allreduce_gathered(self, t: torch.Tensor, op: str) -> Any:
        """Integer and float64 tensors (DDP's unused-parameter map is int32): every rank's
        tensor gathered, reliably, then reduced here in rank order, the same on every rank."""
        _check_cpu(t, "all_reduce")
        if op == "average" and not t.dtype.is_floating_point:
            raise gradwire.ConfigError(
                f"all_reduce: AVG of {t.dtype} is not defined: use SUM (and divide), or floats"
            )
        src = t.contiguous()
        outs = [torch.empty_like(src) for _ in range(self._world)]
        def finish() -> List[torch.Tensor]:
            t.copy_(reduce(torch.stack(outs)).to(t.dtype).view_as(t))
            return [t]

        reduce = {
            "sum": lambda s: s.sum(0),
            "average": lambda s: s.sum(0) / self._world,
            "min": lambda s: s.min(0).values,
            "max": lambda s: s.max(0).values,
            "product": lambda s: s.prod(0),
        }[op]
        return self._gather(src, [_bytes_of(o, "all_reduce", True) for o in outs], None, finish)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            _check_float(t, "all_reduce_coalesced")
        if len({t.dtype for t in tensors}) > 1:
            raise gradwire.ConfigError("all_reduce_coalesced: give tensors of one dtype")
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])

        def unpack() -> List[torch.Tensor]:
            at = 0
            for t in tensors:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()
            return tensors

        return self._allreduce_one(flat, op, unpack)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        works = []
        for t in tensors:
            if t.numel() == 0:
                works.append(self._done(tensors))
                continue
            mem = _bytes_of(t, "broadcast", writes=True)
            bound = self._bound()
            works.append(
                self._work(
                    lambda mem=mem: self._session.start_broadcast(mem, root, loss_bound=bound),
                    lambda _r: tensors,
                    lambda mem=mem: self._session.broadcast(
                        _as_float_view(torch.from_numpy(mem)), root, loss_bound=bound
                    ),
                )
            )
        return works[0] if len(works) == 1 else self._chain(works, tensors)

    def _chain(self, works: Sequence[Any], value: Any) -> Any:
        fut = torch.futures.collect_all([w.get_future() for w in works]).then(lambda _: value)
        return _Work(fut)

    def allgather(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        if len(inputs) != 1 or len(outputs) != 1:
            raise gradwire.ConfigError("all_gather: one input tensor per rank (CPU only)")
        out, inp = outputs[0], inputs[0]
        if len(out) != self._world:
            raise gradwire.ConfigError(
                f"all_gather: {len(out)} output tensors for a {self._world}-rank group"
            )
        for o in out:
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise gradwire.ConfigError(
                    "all_gather: every output tensor needs the input's size and dtype "
                    f"({inp.numel()} x {inp.dtype}), got {o.numel()} x {o.dtype}"
                )
        return self._gather(inp, [_bytes_of(o, "all_gather", True) for o in out], outputs)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, inp, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[0] if len(works) == 1 else self._chain(works, outputs)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        if output.numel() != inp.numel() * self._world or output.dtype != inp.dtype:
            raise gradwire.ConfigError(
                f"all_gather_into_tensor: the output must hold world x input "
                f"({self._world} x {inp.numel()} {inp.dtype}), not {output.numel()} "
                f"{output.dtype}"
            )
        whole = _bytes_of(output, "all_gather_into_tensor", True)
        n = whole.size // self._world if self._world else 0
        return self._gather(inp, [whole[r * n : (r + 1) * n] for r in range(self._world)], output)

    def _gather(
        self,
        inp: torch.Tensor,
        outs: List[Any],
        value: Any,
        after: Optional[Callable[[], Any]] = None,
    ) -> Any:
        """All-gathers ``inp``'s bytes into ``outs`` (one per rank); the work's value is
        ``after()`` when given (run once the bytes are in), else ``value``."""
        src = _bytes_of(inp, "all_gather", False)
        n = src.size
        if n == 0:
            return self._done(after() if after else value)
        if not self._async:
            return self._gather_blocking(src, outs, value, after)
        per = self._padded(n)
        staging = torch.zeros(per * self._world, dtype=torch.uint8).numpy()
        mine = self._session.chunk(staging.size, self._rank)
        staging[mine[0] : mine[0] + n] = src

        def finish(_r: Any) -> Any:
            for r, o in enumerate(outs):
                a, _ = self._session.chunk(staging.size, r)
                o[:] = staging[a : a + n]
            return after() if after else value

        return self._work(lambda: self._session.start_all_gather(staging), finish, lambda: None)

    def _gather_blocking(
        self, src: Any, outs: List[Any], value: Any, after: Optional[Callable[[], Any]]
    ) -> Any:
        """All-gather on the flow transport: a broadcast from each rank in turn."""
        fut: Future = Future()
        try:
            for r, o in enumerate(outs):
                if r == self._rank:
                    o[:] = src
                as_f = torch.from_numpy(o)
                # broadcast() takes float arrays: move the bytes as float16 pairs when even
                self._session.broadcast(_as_float_view(as_f), r)
            fut.set_result(after() if after else value)
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        return _Work(fut)

    def reduce_scatter(
        self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        if len(outputs) != 1 or len(inputs) != 1 or len(inputs[0]) != self._world:
            raise gradwire.ConfigError(
                f"reduce_scatter: one output and {self._world} inputs (one per rank)"
            )
        out = outputs[0]
        for t in inputs[0]:
            if t.numel() != out.numel() or t.dtype != out.dtype:
                raise gradwire.ConfigError(
                    "reduce_scatter: every input needs the output's size and dtype"
                )
        return self._scatter(inputs[0], out, opts, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, inp, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[0] if len(works) == 1 else self._chain(works, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        if inp.numel() != output.numel() * self._world or inp.dtype != output.dtype:
            raise gradwire.ConfigError(
                f"reduce_scatter_tensor: the input must hold world x output ({self._world} x "
                f"{output.numel()} {output.dtype}), not {inp.numel()} {inp.dtype}"
            )
        flat = inp.reshape(-1)
        n = output.numel()
        return self._scatter([flat[r * n : (r + 1) * n] for r in range(self._world)], output, opts, output)

    def _scatter(self, pieces: List[torch.Tensor], out: torch.Tensor, opts: Any, value: Any) -> Any:
        _check_float(out, "reduce_scatter")
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if not self._async:
            raise gradwire.ConfigError(
                "reduce_scatter needs the message layer, and this session runs on the flow "
                "transport"
            )
        n = out.numel()
        if n == 0:
            return self._done(value)
        es = out.element_size()
        per = self._padded(n * es) // es
        staging = torch.zeros(per * self._world, dtype=out.dtype)
        for r, p in enumerate(pieces):
            a, _ = self._session.chunk(staging.numel() * es, r)
            staging[a // es : a // es + n].copy_(p.reshape(-1))
        bound = self._bound() if op in ("sum", "average") else 0.0
        mine = self._session.chunk(staging.numel() * es, self._rank)[0] // es

        def finish(_r: Any) -> Any:
            out.copy_(staging[mine : mine + n].view_as(out))
            return value

        return self._work(
            lambda: self._session.start_reduce_scatter(staging, op=op, loss_bound=bound),
            finish,
            lambda: None,
        )

    def barrier(self, opts: Any = None) -> Any:
        return self._work(self._session.start_barrier, lambda _r: None, self._session.barrier)

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        t = tensors[0]
        mem = _bytes_of(t, "send", False)
        if t.dtype in _REDUCE_DTYPES:
            # Float data is tagged as DLCP does (ECN-capable by gradient magnitude).
            start = lambda: self._session.start_send(t, dst, tensor=tag)  # noqa: E731
        else:
            start = lambda: self._session.start_send(mem, dst, tensor=tag, raw=True)  # noqa: E731
        return self._work(
            start,
            lambda _r: tensors,
            lambda: self._session.send(_as_float_view(torch.from_numpy(mem)), dst, tensor=tag),
        )

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        t = tensors[0]
        mem = _bytes_of(t, "recv", True)
        return self._work(
            lambda: self._session.start_recv(mem, src, tensor=tag),
            lambda _r: tensors,
            lambda: self._session.recv(_as_float_view(torch.from_numpy(mem)), src, tensor=tag),
        )

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        raise gradwire.ConfigError(
            "recv from any source is not supported by gradwire: name the sender (src=...)"
        )

    def shutdown(self) -> None:
        self._completer.close()
        self._session.close()

    def abort(self) -> None:
        self.shutdown()


def _as_float_view(t: torch.Tensor) -> torch.Tensor:
    if t.numel() % 2 == 0:
        return t.view(torch.float16)
    raise gradwire.ConfigError(
        "on the flow transport gradwire moves tensors of an even number of bytes only: pad "
        "the tensor"
    )


# Every gradwire process group this process made, oldest first (the default group's first).
_groups: List["weakref.ReferenceType[ProcessGroupGradwire]"] = []


def message_stats() -> List[Optional[dict]]:
    """The message layer's counters (``gradwire.Session.message_stats``) of every gradwire
    process group of this process that is still alive, oldest first: the default group's
    first. Where a monitoring loop or a test reads frames sent, resends and refusals
    (``unauthenticated`` and ``replayed`` count the datagrams a job with a secret refused)."""
    live = [g() for g in _groups]
    return [g._session.message_stats() for g in live if g is not None]


def _create(dist_opts: Any, options: Any) -> ProcessGroupGradwire:
    if options is not None and not isinstance(options, Options):
        raise gradwire.ConfigError(
            f"pg_options for the gradwire backend must be gradwire.distributed.Options, not "
            f"{type(options).__name__}"
        )
    return ProcessGroupGradwire(
        dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout, options
    )


def _register() -> None:
    if BACKEND.upper() in dist.Backend._plugins:  # imported twice (reload): already there
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


_register()
