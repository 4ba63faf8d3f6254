"""Shared helpers of the Python tests: multi-process jobs on 127.0.0.1, bounded in time.

Every job's processes run in their own sessions (process groups); whatever happens, a test's
children are killed before it ends, so a failing or hanging test leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def reserve_port() -> socket.socket:
    """A TCP port on 127.0.0.1 reserved while the returned socket is open: bound with
    SO_REUSEADDR but never listening, so the job's own listener (SO_REUSEADDR, as std's,
    torch's and gradwire's are) can bind it, while the kernel hands it to no port-0 bind and
    another explicit bind conflicts. Never found free, dropped and bound again later."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    output: dict | None  # the JSON the rank wrote, if any
    log: str


class Job:
    """`world` processes of `script`, each with torchrun's environment on 127.0.0.1."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.ports: list[socket.socket] = []

    def run(
        self,
        script: Path,
        args: list[str],
        world: int,
        timeout: float,
        env: dict[str, str] | None = None,
        wait_for: list[int] | None = None,
    ) -> list[RankResult]:
        """Run the job until every rank (or the ranks `wait_for`) exited, or `timeout`
        seconds; then kill what is left (its returncode is None)."""
        reservation = reserve_port()
        self.ports.append(reservation)  # held until kill(): the job's master binds it
        port = reservation.getsockname()[1]
        logs, outs = [], []
        for rank in range(world):
            out = self.tmp / f"rank{rank}.json"
            out.unlink(missing_ok=True)
            outs.append(out)
            e = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            )
            e.pop("GRADWIRE_IP", None)
            e.update(env or {})
            log = open(self.tmp / f"rank{rank}.log", "w+")
            logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args, "--out", str(out)],
                    env=e,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        procs = self.procs[-world:]
        awaited = [procs[r] for r in (range(world) if wait_for is None else wait_for)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in awaited):
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
        self.kill()
        results = []
        for rank, (code, out, log) in enumerate(zip(codes, outs, logs)):
            log.seek(0)
            text = log.read()
            log.close()
            try:
                output = json.loads(out.read_text())
            except (OSError, ValueError):
                output = None
            results.append(RankResult(rank, code, output, text))
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for s in self.ports:
            s.close()
        self.ports.clear()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.kill()


def explain(results: list[RankResult]) -> str:
    """Every rank's exit code and log tail, for assertion messages."""
    return "\n".join(
        f"--- rank {r.rank}: exit {r.returncode}\n{r.log[-3000:]}" for r in results
    )


def needs_root() -> None:
    """The project's rule: skip visibly without root, fail when GRADWIRE_REQUIRE_PRIV=1."""
    if os.geteuid() != 0:
        if os.environ.get("GRADWIRE_REQUIRE_PRIV") == "1":
            pytest.fail("needs root (GRADWIRE_REQUIRE_PRIV=1 forbids skipping)")
        pytest.skip("SKIPPED: needs root")
