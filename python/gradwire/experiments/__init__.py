"""gradwire's experiments with PyTorch.

``python -m gradwire.experiments.convergence --out DIR``: data-parallel training on the
emulated fabric, PyTorch's Gloo all-reduce against gradwire's bounded-loss all-reduce (DLCP
§2.3, §5.3: a bounded loss does not slow convergence).

``python -m gradwire.experiments.ddp_bench --out DIR``: DDP's iteration time with Gloo,
with ``init_process_group("gradwire")`` and with gradwire's overlapping hook.

Their own dependencies are the package's ``experiments`` extra
(``pip install "./python[experiments]"``); :func:`require_extras` checks them before a run
starts, so a long run never ends on a missing plotting library.
"""

from __future__ import annotations

import importlib.util

#: (module, pip name) of what the experiments import.
EXTRAS = (("torch", "torch"), ("sklearn", "scikit-learn"), ("matplotlib", "matplotlib"))


def require_extras() -> None:
    """SystemExit naming what to install if an experiment dependency is missing."""
    missing = [pip for mod, pip in EXTRAS if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit(
            f"the experiments need {', '.join(missing)}, which this Python lacks: install "
            "gradwire with its experiments extra, pip install \"./python[experiments]\" (or "
            f"pip install {' '.join(missing)})"
        )
