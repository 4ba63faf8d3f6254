"""Shared helpers of the Python tests: multi-process jobs on 127.0.0.1, bounded in time.

Every job's processes run in their own sessions (process groups); whatever happens, a test's
children are killed before it ends, so a failing or hanging test leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
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


def run_ok(job: Job, script: Path, scenario: str, world: int, timeout: float, *args: str) -> list[dict]:
    """Runs `script`'s `scenario` as a job of `world` ranks; every rank must exit 0 with its
    JSON, which is returned in rank order."""
    results = job.run(script, [scenario, *args], world, timeout)
    assert all(r.returncode == 0 and r.output is not None for r in results), explain(results)
    return [r.output for r in results]


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


# -- Rust helper programs ----------------------------------------------------------------------

CARGO_BUILD_TIMEOUT = 900.0  # seconds: a cold build of the workspace's crates on 2 cores


def _cargo() -> str:
    found = shutil.which("cargo")
    if found:
        return found
    for d in (Path.home() / ".cargo" / "bin", Path("/root/.cargo/bin"), Path("/usr/local/cargo/bin")):
        if (d / "cargo").is_file():
            return str(d / "cargo")
    # The package itself is built with cargo (maturin): a missing cargo is a broken setup.
    pytest.fail("cargo not found (PATH, ~/.cargo/bin): it builds the Rust helper programs")


def cargo_example(package: str, example: str) -> Path:
    """Builds example `example` of workspace crate `package` (cargo's own up-to-date check:
    seconds when nothing changed) and returns its executable. Bounded by
    CARGO_BUILD_TIMEOUT; cargo and its compilers are killed if it runs out."""
    cmd = [_cargo(), "build", "--locked", "-p", package, "--example", example,
           "--message-format=json-render-diagnostics"]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("CARGO_TARGET_DIR", str(REPO / "target"))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=CARGO_BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        pytest.fail(f"{' '.join(cmd)}: not done in {CARGO_BUILD_TIMEOUT:.0f} s")
    finally:
        _kill_group(proc)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-5000:]}")
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        target = msg.get("target") or {}
        if msg.get("reason") == "compiler-artifact" and target.get("name") == example and msg.get("executable"):
            return Path(msg["executable"])
    pytest.fail(f"{' '.join(cmd)}: cargo named no executable for {example}:\n{out[-3000:]}")


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills `proc`'s process group (it was started in its own session) unless it has been
    reaped, then reaps it."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class LineChild:
    """A helper program speaking one line at a time on stdin/stdout, in its own session.
    Leaving the `with` block closes its stdin (its signal to finish), gives it a few seconds,
    then kills it; it is reaped on every path."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = open(log, "w+")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            start_new_session=True,
        )  # fmt: skip
        self._buf = b""

    def __enter__(self) -> "LineChild":
        return self

    def __exit__(self, *exc) -> None:
        self.finish(timeout=10.0)

    def finish(self, timeout: float) -> int | None:
        """Closes stdin and waits up to `timeout` seconds for the exit code (None: it had to be
        killed). Reaped either way."""
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except BrokenPipeError:
                    pass
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        finally:
            _kill_group(self.proc)
            for f in (self.proc.stdout,):
                if f:
                    f.close()
            self.log.close()

    def stderr(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def write_line(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def read_line(self, timeout: float) -> str:
        """The child's next line, waiting at most `timeout` seconds (fails the test if it
        exits or stays silent)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    pytest.fail(f"no line from {self.proc.args[0]} in {timeout} s; stderr:\n{self.stderr()}")
                chunk = os.read(fd, 4096)
                if not chunk:
                    pytest.fail(
                        f"{self.proc.args[0]} closed its output (exit {self.proc.poll()}); "
                        f"stderr:\n{self.stderr()}"
                    )
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()


@pytest.fixture(scope="session")
def forged_peer_exe() -> Path:
    """capi/examples/forged_peer.rs (capi/tests/common/forge.rs as a program): a rank 1 that
    answers rank 0's first all-reduce with contributor sets of the test's choosing."""
    return cargo_example("gradwire-capi", "forged_peer")
