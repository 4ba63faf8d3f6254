"""The all-reduce benchmark (``gradwire.experiments.allreduce_bench``): how it checks results
and judges rows (no processes), its quick sweep on loopback end to end, and a small fabric case
with link loss (root). The end-to-end tests assert that every result was checked and what the
rows must hold (identical results on every rank, frames and CPU time counted), never timings.

Known today (issue #23): with a loss bound gradwire can fail a case (ranks holding different
results when blocks go missing; the message layer's ring refusing its own contributor sets on
tensors of fewer blocks than ranks). The benchmark reports such a case as failed, with its
reason and no time; these tests then end as an expected failure naming the cases, after every
other assertion passed (Gloo and p = 0 must be correct), and pass once p > 0 is.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO, needs_root
from test_convergence import fabric_lock, gradwire_binary, stop_group

from gradwire.experiments import allreduce_bench as bench
from gradwire.experiments import allreduce_bench_worker as worker
from gradwire.experiments import convergence as conv

# ---------------------------------------------------------------------------------------------
# Checking and judging, without processes.


def report(sets: list[list[int]], block_elems: int) -> SimpleNamespace:
    """The fields of a ReduceReport that the check reads."""
    complete = sum(len(s) == 4 for s in sets)
    return SimpleNamespace(blocks=len(sets), complete_blocks=complete, block_contributors=sets,
                           block_elems=block_elems, delivered_fraction=0.9)  # fmt: skip


def test_the_check_is_the_documented_sum_of_the_contributors():
    pat = worker.Pattern(10, rank=0)
    # Complete: the sum over ranks 0..3 of (r + 1) times the pattern, exactly.
    step = worker.Step.of(report([[0, 1, 2, 3]] * 3, 4), 4, True, 10)
    assert step.scale is None and step.partial == 0
    assert np.array_equal(worker.expected(pat, step.factor, step), pat.base * 10)
    # Block 1 missed ranks 1 and 3: the sum of ranks 0 and 2 (1 + 3) times world / 2; block 2
    # has rank 2 only: 3 times 4. Block 1 is elements 4..7.
    step = worker.Step.of(report([[0, 1, 2, 3], [0, 2], [2]], 4), 4, True, 10)
    assert step.partial == 2
    want = pat.base * np.repeat(np.float32([10, 8, 12]), 4)[:10]
    assert np.array_equal(worker.expected(pat, step.factor, step), want)
    # Scales that are not exact binary fractions are applied as float32 multiplications.
    step = worker.Step.of(report([[0, 1, 2]], 10), 4, True, 10)
    want = (pat.base * np.float32(6)) * (np.float32(4) / np.float32(3))
    assert np.array_equal(worker.expected(pat, step.factor, step), want)
    # A later operation on identical buffers multiplies by the number of contributors.
    step = worker.Step.of(report([[0, 1, 2, 3], [1]], 5), 4, False, 10)
    assert list(step.factor) == [4, 1] and list(step.scale) == [1, 4]
    # Gloo (no report) is complete.
    step = worker.Step.of(None, 3, True, 10)
    assert list(step.factor) == [6] and step.scale is None


def test_in_place_chunks_stay_exact():
    for world in range(2, 9):
        k = worker.chunk_length(world)
        assert k >= 2
        # The largest value after k in-place sums is an exact float32 integer, and one more is not
        # guaranteed to be.
        assert 7 * world * (world + 1) / 2 * world ** (k - 1) <= 2**24 < 7 * world * (world + 1) / 2 * world**k


def test_sizes_and_iterations():
    assert bench.parse_sizes("4:64M") == [4 << (2 * i) for i in range(13)]
    assert bench.parse_sizes("1K,4,64KiB") == [4, 1024, 65536]
    for bad in ("3", "4:2", "6,8", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_sizes(bad)
    assert bench.scaled(50, 5, 1024) == 50
    assert bench.scaled(50, 5, 1 << 20) == 12
    assert bench.scaled(50, 5, 64 << 20) == 5


def row(variant, size, rep, p50, **kw):
    r = {"net": "loopback", "link_loss": 0.0, "ranks": 4, "variant": variant, "size_bytes": size,
         "repeat": rep, "impl": "gloo" if variant == "gloo" else "gradwire", "correct": True, "valid": True,
         "time_p50_us": p50, "cpu_s_per_op": 1e-3, "frames_per_op": 10.0, "other_cpu_share": 0.0}  # fmt: skip
    r.update(kw)
    return r


def test_ratios_use_only_usable_rows():
    rows = [
        row("gloo", 4, 0, 100.0), row("gradwire-p0", 4, 0, 50.0),
        row("gloo", 4, 1, 100.0), row("gradwire-p0", 4, 1, 80.0),
        row("gloo", 4, 2, 100.0), row("gradwire-p0", 4, 2, 10.0, other_cpu_share=0.5),  # disturbed
        row("gloo", 64, 0, 100.0), row("gradwire-p0", 64, 0, None, correct=False, failure="wrong"),
        row("gloo", 256, 0, 100.0, valid=False), row("gradwire-p0", 256, 0, 30.0),
    ]  # fmt: skip
    bench.mark(rows, 0.1)
    by = {t["size_bytes"]: t for t in bench.ratios(rows)}
    assert by[4]["repeats"] == 2 and by[4]["time_ratio"] == pytest.approx(0.65)
    assert (by[4]["time_ratio_min"], by[4]["time_ratio_max"]) == (0.5, 0.8)
    assert by[64]["time_ratio"] is None and by[256]["time_ratio"] is None
    text = bench.summary_md(rows, bench.ratios(rows))
    assert "0.65x [0.50-0.80]" in text
    lines = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ") and "fr" not in ln}
    assert "FAILED" in lines["64 B"] and "invalid" in lines["256 B"]


# ---------------------------------------------------------------------------------------------
# End to end.


def run_bench(args: list[str], out: Path, timeout: float) -> tuple[int, str]:
    """The benchmark as a child process in its own session, bounded by `timeout`; on any
    failure it is stopped (SIGTERM: it kills its ranks and takes its testbed down; then
    SIGKILL to the group)."""
    cmd = [sys.executable, "-m", "gradwire.experiments.allreduce_bench", "--out", str(out), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=conv.die_with_parent(signal.SIGTERM))
    try:
        log, _ = proc.communicate(timeout=timeout)
    except BaseException as e:
        log = stop_group(proc, grace=60)
        if isinstance(e, subprocess.TimeoutExpired):
            raise AssertionError(f"{' '.join(cmd)} took over {timeout:.0f} s:\n{log[-4000:]}") from e
        raise
    return proc.returncode, log


def variants_of(doc: dict) -> set[str]:
    """Gloo and gradwire at p = 0 and 1 % for each algorithm the session accepted (or the one
    it has), as the ranks resolved them; the same in every run."""
    resolved = [{v["name"] for v in run["worker"]["variants"]} for run in doc["runs"]]
    assert all(r == resolved[0] for r in resolved), resolved
    accepted = doc["runs"][0]["worker"]["algorithms"].get("accepted") or [None]
    assert resolved[0] == {"gloo"} | {f"gradwire{'-' + a if a else ''}-p{p}" for a in accepted for p in (0, 1)}
    return resolved[0]


def check_rows(doc: dict) -> list[dict]:
    """The invariants of every row. Gloo and p = 0 must be checked and correct; a case at
    p > 0 may have failed (issue #23, known), but only as a failure: with its reason and
    without a time. Returns those failures."""
    rows = doc["rows"]
    assert rows, "no rows"
    assert {r["variant"] for r in rows} == variants_of(doc)
    failed = []
    for r in rows:
        tag = f"{r['variant']} {r['size_bytes']} B x{r['ranks']}"
        if not r["correct"]:
            assert "time_p50_us" not in r and r["failure"], ("a failed case has a reason, no time", tag, r)
            assert r["impl"] == "gradwire" and r["loss_bound"] > 0, (tag, r["failure"])
            failed.append(r)
            continue
        assert r["checked"] is True and r["failure"] is None, (tag, r)
        # Every rank checked every operation it ran, and all ran the same number.
        assert len(r["ops_checked"]) == r["ranks"] and len(set(r["ops_checked"])) == 1, (tag, r)
        assert r["ops_checked"][0] == r["warmup"] + r["iters"] + r["counted_ops"], (tag, r)
        assert r["results_identical"] is True, (tag, r)
        assert r["frames_per_op"] > 0 and r["cpu_s_per_op"] > 0, (tag, r)
        assert r["time_p99_us"] >= r["time_p50_us"] > 0, (tag, r)
        n = r["ranks"]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (n - 1) / n)
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_p50_us"] / 1e3)
        if r["loss_bound"] == 0 or r["impl"] == "gloo":
            assert r["partial_blocks"] == 0, (tag, r)
        if r["impl"] == "gradwire":
            # The layer's own counters over the case: data moved, nothing refused.
            m = r["msg_counters"]
            assert r["msg_ops"] == r["ops_checked"][0], (tag, r)
            assert m["data_placed"] > 0 and m["refused"] == 0 and m["unknown_source"] == 0, (tag, m)
        else:
            assert "msg_counters" not in r, (tag, r)
    return failed


def check_outputs(out: Path, doc: dict) -> None:
    for key in ("date", "kernel", "cpu_count", "torch", "command", "build_commit", "native_sha256"):
        assert doc[key], key
    assert (out / "allreduce.csv").read_text().count("\n") == len(doc["rows"]) + 1
    assert (out / "allreduce.png").stat().st_size > 10_000
    summary = (out / "summary.md").read_text()
    assert all(v in summary for v in variants_of(doc))


def xfail_known(failed: list[dict]) -> None:
    """After every other assertion: the known failures at p > 0, named, as an expected failure."""
    if failed:
        pytest.xfail(f"issue #23: gradwire at p > 0 failed {len(failed)} case(s): " + "; ".join(
            f"{r['variant']} {r['size_bytes']} B x{r['ranks']}: {r['failure'][:160]}" for r in failed[:4]))


def test_quick_loopback_sweep_checks_every_result(tmp_path):
    out = tmp_path / "bench"
    code, log = run_bench(["--quick"], out, timeout=400)
    doc = json.loads((out / "allreduce.json").read_text())
    runs = [(r["net"], r["ranks"], r.get("error")) for r in doc["runs"]]
    assert runs == [("loopback", 2, None), ("loopback", 3, None)], log[-3000:]
    failed = check_rows(doc)
    assert code == (1 if failed else 0), log[-3000:]
    sizes = bench.parse_sizes(bench.QUICK["sizes"])
    for n in (2, 3):
        for v in variants_of(doc):
            assert sorted(r["size_bytes"] for r in doc["rows"] if r["ranks"] == n and r["variant"] == v) == sizes
    check_outputs(out, doc)
    xfail_known(failed)


def test_fabric_case_with_link_loss(tmp_path):
    needs_root()
    out = tmp_path / "bench"
    binary = gradwire_binary()
    args = ["--net", "fabric", "--link-loss", "0.02", "--ranks", "2", "--sizes", "4,64K", "--iters", "5",
            "--warmup", "1", "--repeats", "1", "--counted-target-s", "0.3", "--quiet-wait", "0", "--bin", binary]
    with fabric_lock():
        try:
            code, log = run_bench(args, out, timeout=240)
        finally:
            # Taken down by the benchmark on every path but a SIGKILL; make sure.
            subprocess.run([binary, "testbed", "down", bench.FABRIC_NAME], capture_output=True, timeout=120)
    doc = json.loads((out / "allreduce.json").read_text())
    (run,) = doc["runs"]
    assert run["error"] is None, log[-3000:]
    assert run["fabric_counters"]["link_lost"] > 0, run  # the links did lose frames
    failed = check_rows(doc)
    for r in doc["rows"]:
        assert isinstance(r["valid"], bool)
        assert r["fabric"]["rx"] > 0, r["fabric"]
    assert code == (1 if failed else 0), log[-3000:]
    check_outputs(out, doc)
    status = json.loads(subprocess.run([binary, "testbed", "status", "--json"], capture_output=True, text=True,
                                       timeout=60).stdout)
    assert bench.FABRIC_NAME not in [t["name"] for t in status], "the testbed was left up"
    xfail_known(failed)
