"""gradwire: bounded-loss collectives and point-to-point tensor transfers for DNN training.

Set up a session with your own all-gather (``Endpoint`` then ``connect``) or with gradwire's
rendezvous (``Session.rendezvous``), then reduce, broadcast, send and receive numpy arrays or
CPU torch tensors in place::

    import numpy as np, gradwire
    s = gradwire.Session.rendezvous("10.0.0.1:29500", rank, world, "10.0.0.2")
    grad = np.ones(1 << 20, dtype=np.float32)
    report = s.all_reduce(grad, op="average", loss_bound=0.01)

Every operation works on the array's own memory with the GIL released; a second gradwire
operation on overlapping memory raises ``ConfigError`` while the first runs (unless both only
read it). Errors are ``GradwireError`` subclasses carrying the Rust error's message, ``kind``,
``code`` and ``peer``; after a ``PeerError``, ``DataError`` or ``InternalError`` an in-place
operation's array holds partial values.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _native
from ._native import (
    BroadcastReport,
    Endpoint,
    RecvReport,
    ReduceReport,
    SendReport,
    Session,
    Work,
)

__version__: str = _native.__version__

__all__ = [
    "__version__",
    "GradwireError",
    "ConfigError",
    "SetupError",
    "PeerError",
    "UnusableError",
    "DataError",
    "InternalError",
    "Endpoint",
    "Session",
    "ReduceReport",
    "BroadcastReport",
    "SendReport",
    "RecvReport",
    "Work",
]


class GradwireError(RuntimeError):
    """Any gradwire failure. ``kind`` and ``code`` are the Rust ``ErrorKind``'s name and code
    (the C library's ``GW_ERR_*``); ``peer`` is the rank the error is about, or None."""

    kind: str = "internal"
    code: int = 6
    peer: Optional[int]

    def __init__(self, message: str, *, peer: Optional[int] = None) -> None:
        super().__init__(message)
        self.peer = peer


class ConfigError(GradwireError, ValueError):
    """A bad argument or wrong use: configuration, dtype, array layout, rank out of range."""


class SetupError(GradwireError):
    """Sockets, addresses, the rendezvous or endpoint table, authentication."""


class PeerError(GradwireError):
    """A peer died, timed out or broke the protocol (``peer`` names it)."""


class UnusableError(GradwireError):
    """The session is closed or an earlier operation failed: build a new session."""


class DataError(GradwireError):
    """A peer sent invalid aggregation data (forged or corrupt)."""


class InternalError(GradwireError):
    """A bug in gradwire (an internal thread panicked)."""


# Kind names and codes come from the Rust ErrorKind, so Python and C agree.
for _name, (_kind, _code) in _native.ERROR_KINDS.items():
    _cls = globals()[_name]
    _cls.kind = _kind
    _cls.code = _code
del _name, _kind, _code, _cls


def _as_array(x: Any) -> Tuple[np.ndarray, Optional[str]]:
    """``x`` as a numpy array sharing its memory, and the dtype hint ("bf16" or None).

    Takes numpy arrays as they are (the native module checks them) and CPU torch tensors
    (float32, float16, bfloat16; contiguous), as views of the same memory. torch is imported
    only when ``x`` is a torch object.
    """
    if isinstance(x, np.ndarray):
        return x, None
    if type(x).__module__.startswith("torch"):
        return _torch_as_array(x)
    raise ConfigError(
        f"expected a numpy.ndarray or a CPU torch.Tensor, not {type(x).__module__}."
        f"{type(x).__qualname__}: wrap data with numpy.asarray(..., dtype=numpy.float32)"
    )


def _torch_as_array(t: Any) -> Tuple[np.ndarray, Optional[str]]:
    # Each call makes a new numpy view with a new base object, so numpy's borrow tracking
    # cannot tell that two operations use one tensor: the native side also registers the
    # memory range itself, and refuses overlapping operations whatever object they came from.
    import torch

    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"expected a torch.Tensor, not {type(t).__qualname__}")
    if t.device.type != "cpu":
        raise ConfigError(
            f"gradwire works on CPU tensors, and this one is on {t.device}: copy it with "
            ".cpu() first, or reduce it with a GPU collective library"
        )
    if t.layout != torch.strided:
        raise ConfigError(f"gradwire works on dense tensors, not {t.layout}: use .to_dense()")
    if not t.is_contiguous():
        raise ConfigError(
            "the tensor is not contiguous: pass t.contiguous() and use the result afterwards "
            "(the operation works in place on the tensor's memory)"
        )
    t = t.detach()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: the same bits as int16, and the native side is told.
        return _numpy_view(t.view(torch.int16)), "bf16"
    if t.dtype in (torch.float32, torch.float16):
        return _numpy_view(t), None
    raise ConfigError(
        f"gradwire works on float32, float16 and bfloat16 tensors, not {t.dtype}: "
        "convert with t.float()"
    )


def _numpy_view(t: Any) -> np.ndarray:
    try:
        return t.numpy()
    except (RuntimeError, TypeError) as e:
        # e.g. a tensor with a lazy conjugate or negative bit, which has no plain memory view
        raise ConfigError(
            f"this tensor cannot be viewed as a numpy array ({e}): pass t.resolve_conj()"
            ".resolve_neg().contiguous()"
        ) from e
