"""gradwire's experiments with PyTorch.

``python -m gradwire.experiments.convergence --out DIR``: data-parallel training on the
emulated fabric, PyTorch's Gloo all-reduce against gradwire's bounded-loss all-reduce (DLCP
§2.3, §5.3: a bounded loss does not slow convergence).
"""
