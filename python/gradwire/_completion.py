"""The thread that turns started gradwire operations into completed torch futures.

One per process group (``gradwire.distributed``) or DDP state (``gradwire.ddp``): it waits
for each batch of operations in the order they were started (their ``wait()`` releases the
GIL), runs the batch's ``finish`` on their reports, and completes the batch's future, so
torch's waits and DDP's callbacks run. The batches complete in order, which is the order
every framework that uses them waits in.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Sequence


class Completer:
    """A daemon thread completing futures (see the module doc)."""

    def __init__(self, name: str) -> None:
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(
        self,
        natives: Sequence[Any],
        fut: Any,
        finish: Callable[[list], Any],
        on_error: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        """Once every operation in ``natives`` (gradwire Work objects) is done, complete
        ``fut`` with ``finish(reports)``, or with the first error (``on_error`` sees it
        first, and may add a note)."""
        self._q.put((list(natives), fut, finish, on_error))

    def close(self) -> None:
        """Stops the thread once the batches already added are complete."""
        self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            natives, fut, finish, on_error = item
            del item
            try:
                reports = [n.wait() for n in natives]
                value = finish(reports)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                if on_error is not None:
                    try:
                        on_error(e)
                    except BaseException:  # noqa: BLE001 - the operation's error wins
                        pass
                fut.set_exception(e)
            else:
                fut.set_result(value)
            # Dropping the works releases what they hold (a failed batch's other
            # operations are cancelled and waited for here).
            del natives, fut, finish, on_error
