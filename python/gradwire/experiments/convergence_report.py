"""The convergence experiment's report: which runs may be judged, the targets judged on
them, the CSV and the plot. ``gradwire.experiments.convergence`` runs the experiment and
writes them; this module only reads its records.

A run may be judged only when it is valid (the emulated fabric kept its clock) and every
rank of its world reported. Targets (issue #24), for each workload at 4 workers:

- replica drift exactly 0 for every gradwire run;
- at 2 % link loss, every rank's final accuracy (digits) within 1 percentage point of Gloo's
  worst rank at 0 %, or (charlm) every rank's final validation loss within 1 % of it;
- mean iteration time <= 0.8x Gloo's at 0 % link loss and <= 0.5x Gloo's at 2 %.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

# Variants whose iteration time and final quality are judged against Gloo's.
JUDGED = ("gradwire-p0", "gradwire-p1", "gradwire-p10", "backend-p0", "backend-p10")
CLEAN_LIMIT = 0.8
LOSSY_LIMIT = 0.5
LOSSY = 0.02


def exclusion_reasons(r: dict) -> list[str]:
    """Why run `r` cannot be judged against a target ([] when it can): it must be valid, and
    every rank of its world must have reported a final accuracy."""
    reasons = []
    if r.get("valid") is not True:
        reasons.append("not valid: " + ("; ".join(r.get("invalid_reasons") or []) or "valid is not true"))
    world = r.get("world")
    reported = r.get("ranks_reported")
    acc = r.get("rank_final_accuracy")
    if not isinstance(world, int) or world < 1:
        reasons.append("world size not recorded")
    elif not isinstance(reported, list):
        reasons.append("ranks not recorded")
    else:
        missing = sorted(set(range(world)) - set(reported))
        if missing:
            reasons.append(f"no result from rank(s) {missing} of {world}")
        if len(reported) != len(set(reported)) or not set(reported) <= set(range(world)):
            reasons.append(f"ranks reported {reported}, expected each of 0..{world - 1} once")
        if (
            not isinstance(acc, list)
            or len(acc) != len(reported)
            or any(not isinstance(a, (int, float)) or math.isnan(a) for a in acc)
        ):
            reasons.append("final accuracy not recorded for every reporting rank")
    return reasons


def run_tag(r: dict) -> str:
    return f"{r['variant']} at {r['link_loss']:.0%} link loss"


def excluded_runs(results: list[dict]) -> list[dict]:
    """Every run no target may be judged on, with why: for convergence.json."""
    return [
        {"variant": r["variant"], "link_loss": r["link_loss"], "reasons": why}
        for r in results
        if (why := exclusion_reasons(r))
    ]


def _worst_rank(r: dict, key: str, worst) -> tuple[int, float] | None:
    pairs = [
        (k, a)
        for k, a in zip(r.get("ranks_reported") or [], r.get(key) or [])
        if isinstance(a, (int, float)) and not math.isnan(a)
    ]
    return worst(pairs, key=lambda p: p[1]) if pairs else None


def worst_rank_accuracy(r: dict) -> tuple[int, float] | None:
    """(rank, final accuracy) of the run's lowest-accuracy rank, or None without figures."""
    return _worst_rank(r, "rank_final_accuracy", min)


def worst_rank_loss(r: dict) -> tuple[int, float] | None:
    """(rank, final held-out loss) of the run's highest-loss rank, or None without figures."""
    return _worst_rank(r, "rank_final_loss", max)


def _judged(target: str, runs: list[dict], value_key: str, value, passes: bool) -> dict:
    """A target's record: met only when every run it needs may be judged and `passes`."""
    excluded = [{"run": run_tag(r), "reasons": why} for r in runs if (why := exclusion_reasons(r))]
    judged = not excluded and value is not None
    return {
        "target": target,
        "runs": [run_tag(r) for r in runs],
        value_key: value,
        "judged": judged,
        "valid": not excluded,
        "met": bool(judged and passes),
        "excluded": excluded,
    }


# Per workload: the per-rank figure, the baseline's worst rank, how a difference is
# expressed (percentage points of accuracy, or percent of the loss), and the target's words.
QUALITY = {
    "digits": ("rank_final_accuracy", worst_rank_accuracy, lambda x, b: 100 * (x - b), "value_pp",
               "accuracy", "final accuracy of every rank within 1 pp of gloo at 0%"),
    "charlm": ("rank_final_loss", worst_rank_loss, lambda x, b: 100 * (x - b) / b, "value_pct",
               "loss", "final validation loss of every rank within 1% of gloo at 0%"),
}


def _quality_target(v: str, lossy: dict, gloo0: dict, workload: str) -> dict:
    """Every rank of `lossy` against the baseline's worst rank: the rank farthest from it
    decides (Gloo's ranks hold identical models; gradwire's might not)."""
    key, worst_of, diff, value_key, what, words = QUALITY[workload]
    base = worst_of(gloo0)
    vals = [x for x in (lossy.get(key) or []) if isinstance(x, (int, float))]
    d, worst = None, None
    if base is not None and vals and base[1] > 0:
        worst = max(vals, key=lambda x: abs(x - base[1]))
        d = diff(worst, base[1])
    t = _judged(f"{v} at 2% link loss: {words}", [lossy, gloo0], value_key, d,
                d is not None and abs(d) <= 1.0)
    t[f"worst_rank_{what}"] = worst
    t[f"baseline_{what}"] = base[1] if base else None
    return t


def targets(results: list[dict], workload: str = "digits") -> list[dict]:
    """The issue's targets, each with the figures it was judged on. A target whose runs are
    all absent (variants not run) is left out; one whose runs are present but cannot be
    judged is listed, not met, with the runs excluded and why."""
    def get(variant, loss):
        return next((r for r in results if r["variant"] == variant and r["link_loss"] == loss), None)

    out = []
    for r in results:
        if r["variant"] != "gloo" and r.get("completed"):
            d = r.get("replica_drift")
            out.append(_judged(
                f"{r['variant']} at {r['link_loss']:.0%} link loss: replica drift exactly 0",
                [r], "value_drift", d, d == 0.0,
            ))
    gloo0, gloo2 = get("gloo", 0.0), get("gloo", LOSSY)
    for v in JUDGED:
        lossy, clean = get(v, LOSSY), get(v, 0.0)
        if lossy and gloo0:
            out.append(_quality_target(v, lossy, gloo0, workload))
        for ref, base_run, limit in ((lossy, gloo2, LOSSY_LIMIT), (clean, gloo0, CLEAN_LIMIT)):
            if ref and base_run:
                ratio = None
                if ref.get("iteration_ms_mean") and base_run.get("iteration_ms_mean"):
                    ratio = ref["iteration_ms_mean"] / base_run["iteration_ms_mean"]
                out.append(_judged(
                    f"{v} at {ref['link_loss']:.0%} link loss: mean iteration time <= {limit}x gloo's",
                    [ref, base_run], "value_ratio", ratio, ratio is not None and ratio <= limit,
                ))
    return out


def write_csv(path: Path, results: list[dict]) -> None:
    cols = ["variant", "link_loss", "final_accuracy", "final_loss", "iteration_ms_mean", "iteration_ms_p50",
            "iteration_ms_p99", "delivered_fraction_mean", "delivered_fraction_min", "replica_drift", "valid",
            "completed", "wall_s", "accuracy_per_epoch", "loss_per_epoch"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            row = [r.get(c) for c in cols]
            row[-2] = " ".join(f"{a:.4f}" for a in r.get("accuracy_per_epoch") or [])
            row[-1] = " ".join(f"{a:.4f}" for a in r.get("loss_per_epoch") or [])
            w.writerow(row)


COLORS = {"gloo": "tab:gray", "gradwire-p0": "tab:blue", "gradwire-p1": "tab:green",
          "gradwire-p10": "tab:orange", "backend-p0": "tab:purple", "backend-p10": "tab:red"}


def plot(path: Path, results: list[dict], epochs: int, workload: str = "digits", world: int = 4) -> None:
    """Time-to-accuracy (digits) or time-to-loss (charlm) curves, one panel per link loss,
    and the mean iteration times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = workload == "charlm"
    key = "loss_per_epoch" if lm else "accuracy_per_epoch"
    losses = sorted({r["link_loss"] for r in results})
    fig, axes = plt.subplots(1, len(losses) + 1, figsize=(5 * (len(losses) + 1), 4.2))
    for ax, loss in zip(axes, losses):
        for r in results:
            if r["link_loss"] != loss or not r.get(key):
                continue
            ys = r[key] if lm else [100 * a for a in r[key]]
            xs = r.get("epoch_end_s") or list(range(1, len(ys) + 1))
            label = r["variant"] + ("" if r["valid"] else " (not valid)")
            gloo = r["variant"] == "gloo"  # drawn wide underneath: identical curves stay visible
            ax.plot(xs, ys, marker=None if gloo else ".",
                    color=COLORS.get(r["variant"]), label=label,
                    linestyle="-" if r["valid"] else ":", linewidth=5 if gloo else 1.3,
                    alpha=0.45 if gloo else 1.0, zorder=1 if gloo else 2)
        ax.set_title(f"{'validation loss' if lm else 'test accuracy'}, {loss:.0%} link loss")
        ax.set_xlabel("training time, rank 0 (s)")
        ax.set_ylabel("loss (nats/char)" if lm else "accuracy (%)")
        if not lm:
            ax.set_ylim(80, 100)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right" if lm else "lower right", fontsize=8)
    ax = axes[-1]
    variants = [v for v in COLORS if any(r["variant"] == v for r in results)]
    width = 0.8 / max(len(losses), 1)
    for i, loss in enumerate(losses):
        xs, ys = [], []
        for j, v in enumerate(variants):
            r = next((r for r in results if r["variant"] == v and r["link_loss"] == loss), None)
            if r and r.get("iteration_ms_mean"):
                xs.append(j + (i - (len(losses) - 1) / 2) * width)
                ys.append(r["iteration_ms_mean"])
        bars = ax.bar(xs, ys, width, label=f"{loss:.0%} link loss")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(variants)), variants, rotation=15, fontsize=8)
    ax.set_ylabel("mean iteration time (ms)")
    ax.set_title(f"iteration time ({world} workers)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    what = "char-level transformer LM" if lm else "digits CNN"
    fig.suptitle(f"{what}, DDP on {world} namespaces, {epochs} epochs: Gloo vs gradwire")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
