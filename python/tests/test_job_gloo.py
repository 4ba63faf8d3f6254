"""The README's collective job on Gloo (``gradwire.experiments.job_gloo``): that it reads the
job file and the model as ``gradwire job run`` does and builds the same workload (no
processes), and a 2-iteration run end to end (root: namespaces): every rank reports, every
result was checked, and nothing is left behind, after a run and after one stopped by SIGTERM.
Each end-to-end test holds the fabric lock for its run and is bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, needs_root
from test_convergence import fabric_lock, stop_group

from gradwire.experiments import job_gloo as jg

JOB = REPO / "collective/jobs/racks8.toml"
MODEL = REPO / "control/models/resnet50.toml"
# What `gradwire job run collective/jobs/racks8.toml` reports as "elements" (f32 per
# iteration) and layers for ResNet-50 at the default scale 0.01.
RESNET50_ELEMENTS = 255_571
RESNET50_LAYERS = 54
RUN_TIMEOUT = 300.0  # seconds: 8 torch processes starting on 2 cores, 2 iterations


# ---------------------------------------------------------------------------------------------
# Reading the job and building the workload, without processes.


def test_job_file_and_model_as_gradwire_reads_them():
    job = jg.load_job(JOB)
    assert job["world"] == 8
    assert job["hosts"] == [f"198.18.{r}.{h}" for r in (1, 2) for h in (1, 2, 3, 4)]
    assert job["host_of"] == list(range(8))
    assert (job["master_addr"], job["master_port"]) == ("198.18.1.1", 29500)
    name, layers = jg.model_layers(MODEL, 0.01)
    assert name == "ResNet-50"
    assert len(layers) == RESNET50_LAYERS
    assert sum(n for _, n in layers) == RESNET50_ELEMENTS
    assert all(n >= 1 for _, n in layers)
    # Rust's round: half away from zero (Python's round would give 2 and 0 here).
    assert [jg._round_half_away(x) for x in (2.5, 0.5, 1.49, 3.0)] == [3, 1, 1, 3]
    assert jg.host_mac(0) == "02:67:77:00:00:01" and jg.host_mac(255) == "02:67:77:00:01:00"
    for bad in ("10.0.0.1", "198.18.0.0", "198.19.255.255", "198.20.0.1", "x"):
        assert not jg.in_bench_range(bad), bad


def test_job_file_errors_are_named(tmp_path):
    f = tmp_path / "j.toml"
    f.write_text('job = 1\n[[rank]]\nrank = 0\nhost = "10.0.0.1"\n')
    try:
        jg.load_job(f)
    except jg.JobError as e:
        assert "198.18.0.0/15" in str(e)
    else:
        raise AssertionError("a host outside 198.18.0.0/15 was accepted")
    f.write_text('job = 1\nmaster = "198.18.0.9:1"\n[[rank]]\nrank = 0\nhost = "198.18.0.1"\n')
    try:
        jg.load_job(f)
    except jg.JobError as e:
        assert "master" in str(e)
    else:
        raise AssertionError("a master that is not rank 0's host was accepted")


def test_inputs_and_sums_are_the_gradwire_workload():
    # workload.rs input: small periodic integers.
    for r in range(10):
        for l in range(30):
            for e in range(50):
                v = jg.input_value(r, l, e)
                assert -11.0 <= v <= 11.0 and v == int(v)
                assert v == jg.input_value(r, l, e + jg.PERIOD)
    assert jg.input_value(0, 0, 0) == -11.0 and jg.input_value(1, 2, 3) == (7 + 10 + 9) % 23 - 11
    s = jg.residue_sums(range(8), 5)
    for e in range(2 * jg.PERIOD):
        assert s[e % jg.PERIOD] == sum(jg.input_value(r, 5, e) for r in range(8))
    t = jg.periodic(s, 50)
    assert t.numel() == 50 and [float(x) for x in t[:3]] == s[:3] and float(t[23]) == s[0]


def test_summary_takes_the_slowest_rank_and_drops_warmup():
    reports = [
        {"world": 2, "verified": True, "iterations": [{"ms": 100.0}, {"ms": 10.0}, {"ms": 20.0}]},
        {"world": 2, "verified": True, "iterations": [{"ms": 90.0}, {"ms": 12.0}, {"ms": 18.0}]},
    ]
    s = jg.summarize(reports, warmup=1)
    assert s["per_iteration_ms"] == [100.0, 12.0, 20.0]
    assert s["warmup_dropped"] == 1 and s["mean_ms"] == 16.0 and s["median_ms"] == 16.0
    assert s["verified"] is True
    reports[1]["verified"] = False
    assert jg.summarize(reports)["verified"] is False
    # One iteration: nothing to drop.
    one = [{"world": 1, "verified": True, "iterations": [{"ms": 5.0}]}]
    assert jg.summarize(one)["warmup_dropped"] == 0


# ---------------------------------------------------------------------------------------------
# End to end (root).


def namespaces_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/run/netns") if n.startswith(f"gw{pid}t")) if Path("/run/netns").is_dir() \
        else []  # fmt: skip


def alive_workers(pids: list[int]) -> list[int]:
    """Those of `pids` that still run a job_gloo worker."""
    left = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"job_gloo" in cmd:
            left.append(pid)
    return left


def start(out: Path, iterations: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gradwire.experiments.job_gloo", "--job", str(JOB), "--model", str(MODEL),
           "--iterations", str(iterations), "--timeout", "60", "--deadline", str(RUN_TIMEOUT), "--out", str(out)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def test_two_iterations_every_result_checked_and_cleaned_up(tmp_path):
    needs_root()
    out = tmp_path / "gloo"
    with fabric_lock():
        proc = start(out, iterations=2)
        try:
            log, _ = proc.communicate(timeout=RUN_TIMEOUT + 60)
        except BaseException:
            log = stop_group(proc, grace=30)
            raise AssertionError(f"job_gloo did not finish in {RUN_TIMEOUT + 60} s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    doc = json.loads((out / "job_gloo.json").read_text())
    assert doc["config"]["world"] == 8 and doc["config"]["iterations"] == 2
    assert doc["config"]["layers"] == RESNET50_LAYERS and doc["config"]["elements"] == RESNET50_ELEMENTS
    reports = doc["reports"]
    assert [r["rank"] for r in reports] == list(range(8))
    hosts = jg.load_job(JOB)["rank_hosts"]
    for r in reports:
        assert r["verified"] is True and r["algorithm"] == "gloo" and r["world"] == 8
        assert r["host"] == hosts[r["rank"]]
        assert r["elements"] == RESNET50_ELEMENTS and r["layers"] == RESNET50_LAYERS
        assert [i["iteration"] for i in r["iterations"]] == [1, 2]
        assert all(i["ms"] > 0 for i in r["iterations"])
    s = doc["summary"]
    assert s["verified"] is True and s["iterations"] == 2 and s["warmup_dropped"] == 1
    assert s["mean_ms"] == s["per_iteration_ms"][1] > 0
    # Nothing left behind: the namespaces and the ranks are gone.
    assert len(doc["namespaces"]) == 9  # 8 hosts and the switch
    existing = set(os.listdir("/run/netns")) if Path("/run/netns").is_dir() else set()
    assert not existing & set(doc["namespaces"]), existing & set(doc["namespaces"])
    assert len(doc["worker_pids"]) == 8
    assert alive_workers(doc["worker_pids"]) == []


def test_a_stopped_run_leaves_nothing_behind(tmp_path):
    needs_root()
    out = tmp_path / "gloo"
    with fabric_lock():
        proc = start(out, iterations=100_000)
        try:
            # Wait until the ranks iterate (rank 0 logged its first iteration), then SIGTERM.
            log0 = out / "logs" / "rank0.log"
            deadline = time.monotonic() + RUN_TIMEOUT
            while time.monotonic() < deadline and proc.poll() is None:
                if log0.is_file() and "iteration 1/" in log0.read_text():
                    break
                time.sleep(0.1)
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            running = namespaces_of(proc.pid)
            assert len(running) == 9, running
            pids = [int(p) for ns in running for p in
                    subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
            assert len(pids) >= 8, pids
            os.killpg(proc.pid, signal.SIGTERM)
            log, _ = proc.communicate(timeout=60)
        except BaseException:
            stop_group(proc, grace=30)
            raise
    assert proc.returncode == 1, log[-4000:]
    assert "interrupted by signal" in log, log[-4000:]
    assert namespaces_of(proc.pid) == []
    assert alive_workers(pids) == []
