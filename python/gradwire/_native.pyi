"""Type stubs of gradwire's native module (PyO3). Use it through the ``gradwire`` package."""

from types import TracebackType
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Type, Union

__version__: str

#: ``{exception class name: (ErrorKind name, code)}``, read by the package.
ERROR_KINDS: Dict[str, Tuple[str, int]]

#: A numpy.ndarray (float32 or float16, C-contiguous) or a CPU torch.Tensor (float32, float16,
#: bfloat16; contiguous). Operations work on its own memory with the GIL released: do not touch
#: it from Python code in another thread until the call returns. Another gradwire operation on
#: overlapping memory (the same array or tensor, a view of it, in another thread or session)
#: raises ConfigError while this one runs, unless both only read it (two sends).
ArrayLike = Any

#: ``priority(index, offset, layer, payload) -> (dscp, ect)`` for each segment sent. It runs
#: inside ``send``, on gradwire's sending threads: it may not call its own session (that raises
#: ConfigError, since the session is busy with this very send).
PriorityCallable = Callable[[int, int, int, bytes], Tuple[int, bool]]

class ReduceReport:
    """What an all-reduce did: the per-block loss telemetry."""

    @property
    def elems(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def block_elems(self) -> int:
        """Elements per block: block ``b`` is elements ``b * block_elems ..``."""
    @property
    def complete_blocks(self) -> int:
        """Blocks with every rank's contribution."""
    @property
    def delivered_fraction(self) -> float:
        """Mean over blocks of the fraction of ranks summed in the block."""
    @property
    def rank_delivered(self) -> List[float]:
        """For each rank, the fraction of blocks its contribution reached."""
    @property
    def block_delivered(self) -> List[float]:
        """For each block, the fraction of ranks summed in it."""
    @property
    def block_contributors(self) -> List[List[int]]:
        """For each block, the ranks summed in it, ascending (with ``op="average"`` the block
        is their average). Listed on each access; not in ``to_dict()``."""
    @property
    def elapsed_s(self) -> float: ...
    @property
    def bytes_sent(self) -> int: ...
    def to_dict(self) -> Dict[str, Any]: ...

class BroadcastReport:
    """What a broadcast delivered here."""

    @property
    def blocks(self) -> int: ...
    @property
    def block_elems(self) -> int:
        """Elements per block: block ``b`` is elements ``b * block_elems ..``."""
    @property
    def received_blocks(self) -> int:
        """Blocks that hold the root's values (the others kept their contents)."""
    @property
    def block_received(self) -> List[bool]:
        """For each block, whether it holds the root's values (False: it kept this rank's
        previous contents; only with a loss bound > 0)."""
    @property
    def elapsed_s(self) -> float: ...
    def to_dict(self) -> Dict[str, Any]: ...

class SendReport:
    """What a send did."""

    @property
    def segments(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def retransmitted_segments(self) -> int: ...
    @property
    def elapsed_s(self) -> float: ...
    @property
    def final_rate_bps(self) -> int: ...
    def to_dict(self) -> Dict[str, Any]: ...

class RecvReport:
    """What a receive delivered (segments not received are zero)."""

    @property
    def segments(self) -> int: ...
    @property
    def received_segments(self) -> int: ...
    @property
    def delivered_fraction(self) -> float: ...
    @property
    def missing(self) -> List[Tuple[int, int]]:
        """``(offset, length)`` in bytes of each range that did not arrive (zero in the
        array), in order; empty when everything arrived."""
    @property
    def loss_bound(self) -> float: ...
    @property
    def rounds(self) -> int: ...
    @property
    def elapsed_s(self) -> float: ...
    def to_dict(self) -> Dict[str, Any]: ...

class Work:
    """A started operation (``Session.start_*``). Dropping it before it completed cancels
    the operation (and waits for it to let go of the array)."""

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The operation's report (ReduceReport, BroadcastReport, SendReport, RecvReport;
        None for an all-gather or barrier), or its error raised; later calls give the same.
        TimeoutError if it still runs after ``timeout`` seconds (it keeps running)."""
    def is_completed(self) -> bool: ...

class Endpoint:
    """Phase 1: this rank's sockets, bound; exchange ``address`` with every rank, then
    ``connect``."""

    def __init__(
        self,
        rank: int,
        world: int,
        ip: str,
        *,
        job: int = 1,
        loss_bound: float = 0.0,
        timeout: float = 30.0,
        secret: Optional[bytes] = None,
        inject_loss: float = 0.0,
        seed: int = 0,
        point_to_point: bool = True,
        rate_bps: Optional[int] = None,
        mtu: Optional[int] = None,
    ) -> None: ...
    @property
    def address(self) -> bytes:
        """Opaque bytes every rank must receive, in rank order, for ``connect``."""
    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    def connect(self, table: Sequence[bytes]) -> Session:
        """Phase 2: ``table[r]`` is rank r's address. Consumes the endpoint (a second call
        raises UnusableError); the GIL is released while connecting."""

class Session:
    """One rank's end of a job. One operation at a time: a second thread's call waits for the
    running one (with the GIL released). A call from the session's own priority callable
    raises ConfigError instead (it would wait for itself).

    ``layer`` is the tensor's layer counted from the input: 0 is the front (input) layer, the
    most urgent (DLCP: the next forward pass needs it first); with ``num_layers`` it picks the
    packets' DSCP (``layer < num_layers``); ``num_layers=0``: unknown, the lowest data
    priority.

    On failure an in-place operation (``all_reduce``, ``broadcast``) leaves the array untouched
    if it raised ConfigError (checked before anything is sent); after PeerError, DataError or
    InternalError it stopped part-way and the array holds partial values (unspecified). ``recv``
    writes the array only on success."""

    @staticmethod
    def rendezvous(
        master: str,
        rank: int,
        world: int,
        ip: str,
        *,
        job: int = 1,
        loss_bound: float = 0.0,
        timeout: float = 30.0,
        secret: Optional[bytes] = None,
        inject_loss: float = 0.0,
        seed: int = 0,
        point_to_point: bool = True,
        rate_bps: Optional[int] = None,
        mtu: Optional[int] = None,
    ) -> Session:
        """Both phases through gradwire's rendezvous at ``master`` ("host:port", served by
        rank 0)."""
    @staticmethod
    def init(
        allgather: Callable[[bytes], Sequence[bytes]],
        rank: int,
        world: int,
        ip: str,
        *,
        job: int = 1,
        loss_bound: float = 0.0,
        timeout: float = 30.0,
        secret: Optional[bytes] = None,
        inject_loss: float = 0.0,
        seed: int = 0,
        point_to_point: bool = True,
        rate_bps: Optional[int] = None,
        mtu: Optional[int] = None,
    ) -> Session:
        """Both phases with the caller's all-gather (the C library's ``gw_session_init``):
        ``allgather(address)`` returns every rank's address bytes, in rank order."""
    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def all_reduce(
        self,
        array: ArrayLike,
        *,
        op: Literal["sum", "average"] = "sum",
        loss_bound: Optional[float] = None,
        layer: int = 0,
        num_layers: int = 0,
        dscp: Optional[int] = None,
        algorithm: Literal["auto", "ring", "direct"] = "auto",
        step_deadline: Union[float, Literal["adaptive"], None] = None,
        ranges: Optional[Sequence[Tuple[int, int]]] = None,
        tagging: Literal["magnitude", "layer"] = "magnitude",
        verify_results: bool = False,
    ) -> ReduceReport:
        """All-reduce in place. ``step_deadline`` bounds each reduce-scatter step in time
        (OptiReduce): seconds, or ``"adaptive"`` (1.5 x the 95th percentile of the steps this
        session saw, at least 1 ms; none for the first 8 steps). ``ranges``: ascending,
        disjoint ``(start, end)`` element ranges (the parameters a flat tensor coalesces),
        each held to the loss bound on its own (message layer only). ``tagging``: the
        segments of a bounded all-reduce's lossy steps go ECN-capable by gradient magnitude
        (``"magnitude"``, DLCP's default: the rest are the first a congested switch drops)
        or all ECN-capable (``"layer"``); the layer's DSCP either way. ``verify_results``
        (ring, every rank alike): each chunk that came round the ring is checked against its
        owner's digest, sent directly; a rank that changed one it forwarded raises
        DataError naming the ranks it came through."""
    def broadcast(
        self,
        array: ArrayLike,
        root: int,
        *,
        loss_bound: Optional[float] = None,
        layer: int = 0,
        num_layers: int = 0,
    ) -> BroadcastReport: ...
    def barrier(self) -> None: ...
    def send(
        self,
        array: ArrayLike,
        peer: int,
        *,
        tensor: int = 0,
        layer: int = 0,
        num_layers: int = 0,
        loss_bound: Optional[float] = None,
        priority: Union[None, int, PriorityCallable] = None,
    ) -> SendReport:
        """priority: None (DLCP's tagging: the DSCP of ``layer`` of ``num_layers``, ECN-capable
        by gradient magnitude), an int DSCP (every segment, ECN-capable), or a callable per
        segment. Read-only arrays are fine. With ``point_to_point=False`` only to rank + 1."""
    def recv(
        self,
        array: ArrayLike,
        peer: int,
        *,
        tensor: int = 0,
        layer: int = 0,
        num_layers: int = 0,
        loss_bound: Optional[float] = None,
    ) -> RecvReport:
        """The sender's ``tensor`` id. ``layer`` and ``num_layers`` are not used on the
        receiving side (accepted so that both ends can pass the same options). With
        ``point_to_point=False`` only from rank - 1."""
    def start_all_reduce(
        self,
        array: ArrayLike,
        *,
        op: Literal["sum", "average", "min", "max", "product"] = "sum",
        loss_bound: Optional[float] = None,
        layer: int = 0,
        num_layers: int = 0,
        dscp: Optional[int] = None,
        algorithm: Literal["auto", "ring", "direct"] = "auto",
        step_deadline: Union[float, Literal["adaptive"], None] = None,
        ranges: Optional[Sequence[Tuple[int, int]]] = None,
        tagging: Literal["magnitude", "layer"] = "magnitude",
        verify_results: bool = False,
    ) -> Work:
        """Starts an all-reduce in place and returns at once (message layer only; an
        authenticated session raises ConfigError). Ranks start operations in the same
        order. The array is claimed until the Work completes: do not touch it meanwhile."""
    def start_reduce_scatter(
        self,
        array: ArrayLike,
        *,
        op: Literal["sum", "average", "min", "max", "product"] = "sum",
        loss_bound: Optional[float] = None,
        layer: int = 0,
        num_layers: int = 0,
        dscp: Optional[int] = None,
    ) -> Work:
        """This rank's chunk (``chunk(len, rank)``) ends with the reduction of every rank's
        chunk there."""
    def start_all_gather(self, array: Any) -> Work:
        """``array``: a C-contiguous numpy uint8 array; rank r's chunk (``chunk``), filled by
        rank r, reaches every rank. Reliable."""
    def start_broadcast(self, array: Any, root: int, *, loss_bound: Optional[float] = None) -> Work:
        """``array``: a numpy uint8 array (any tensor's bytes)."""
    def start_barrier(self) -> Work: ...
    def start_send(
        self,
        array: Any,
        peer: int,
        *,
        tensor: int = 0,
        layer: int = 0,
        num_layers: int = 0,
        loss_bound: Optional[float] = None,
        raw: bool = False,
    ) -> Work:
        """Copies the array first (it is free at once). ``raw=True``: a numpy uint8 array."""
    def start_recv(
        self, array: Any, peer: int, *, tensor: int = 0, loss_bound: Optional[float] = None
    ) -> Work:
        """``array``: a numpy uint8 array of the sender's length in bytes."""
    @property
    def block_bytes(self) -> int:
        """Bytes per block (one segment's payload) on the message layer."""
    def chunk(self, length: int, c: int) -> Tuple[int, int]:
        """``(start, end)`` bytes of rank c's chunk of a ``length``-byte array in
        reduce-scatter and all-gather."""
    @property
    def message_layer(self) -> bool:
        """Whether the session runs on the message layer (started operations need it)."""
    def message_stats(self) -> Optional[Dict[str, int]]:
        """The message layer's counters (data_sent, data_resent, ctrl_sent, polls, nacks,
        refused, datagrams_in/out, send_calls, ...), or None when the session does not run on
        the layer (authenticated jobs)."""
    def close(self) -> None:
        """Drops the session (links closed); later calls raise UnusableError. Waits for a
        running operation."""
    def __enter__(self) -> Session: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
