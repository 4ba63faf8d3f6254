"""The convergence experiment's quick mode, end to end (root: namespaces and the fabric).

It runs ``python -m gradwire.experiments.convergence --quick`` (Gloo and gradwire at p = 1 %,
each at 0 % and 2 % link loss, 2 epochs) and checks the JSON's schema, that every run
completed, and that the CSV and the plot were written. Convergence itself is what the full
run (docs/results.md) is for: 2 epochs only show training moving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, needs_root

RESULT_KEYS = {
    "variant": str,
    "link_loss": float,
    "final_accuracy": float,
    "accuracy_per_epoch": list,
    "iteration_ms_mean": float,
    "delivered_fraction_mean": float,
    "valid": bool,
}


def gradwire_binary() -> str:
    """GRADWIRE_BIN, or the release CLI built from this tree (incremental when it is current):
    a stale target/release/gradwire would test old code, and a debug fabric is too slow to
    keep its emulated clock."""
    given = os.environ.get("GRADWIRE_BIN")
    if given:
        return given
    build = subprocess.run(
        ["cargo", "build", "--release", "--locked", "-p", "gradwire-cli"],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return str(REPO / "target" / "release" / "gradwire")


def test_quick_convergence_run_writes_its_results(tmp_path):
    needs_root()
    out = tmp_path / "conv"
    cmd = [sys.executable, "-m", "gradwire.experiments.convergence", "--quick", "--out", str(out),
           "--bin", gradwire_binary()]
    # The experiment bounds each run itself; this bounds the whole and kills its session
    # (the experiment takes its testbed down on SIGTERM).
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        log, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the quick run took over 600 s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]

    doc = json.loads((out / "convergence.json").read_text())
    results = doc["results"]
    assert {(r["variant"], r["link_loss"]) for r in results} == {
        ("gloo", 0.0), ("gradwire-p1", 0.0), ("gloo", 0.02), ("gradwire-p1", 0.02)
    }
    epochs = doc["config"]["epochs"]
    for r in results:
        for key, typ in RESULT_KEYS.items():
            assert isinstance(r[key], typ), (key, r.get(key), r)
        assert r["completed"], r
        assert r["variant"] in ("gloo", "gradwire-p0", "gradwire-p1", "gradwire-p10")
        assert 0.0 <= r["link_loss"] < 1.0
        assert len(r["accuracy_per_epoch"]) == epochs
        assert all(0.0 <= a <= 1.0 for a in r["accuracy_per_epoch"])
        assert r["final_accuracy"] == r["accuracy_per_epoch"][-1]
        # Training moves: well above chance (10 %) after two epochs.
        assert r["final_accuracy"] > 0.3, r
        assert r["iteration_ms_mean"] > 0
        assert 0.0 < r["delivered_fraction_mean"] <= 1.0
    # The lossy runs lost frames on the fabric's links; the lossless ones did not.
    for r in results:
        lost = r["fabric"]["link_lost"]
        assert (lost > 0) == (r["link_loss"] > 0), r["fabric"]
    for t in doc["targets"]:
        assert isinstance(t["met"], bool)
    assert (out / "convergence.csv").read_text().count("\n") == len(results) + 1
    assert (out / "convergence.png").stat().st_size > 10_000
