"""The convergence experiment's training workloads: a model, its data and how it is judged.

- ``digits``: a small CNN on scikit-learn's bundled digits (8x8 images, no download),
  judged by test accuracy; an epoch is one pass over the training split.
- ``charlm``: a character-level transformer language model on ``data/charlm.txt``, a text
  the package ships (a snapshot of gradwire's own design and protocol documents, prose
  only: 171 kB, 107 distinct characters), judged by validation loss (nats per character)
  and next-character accuracy on a fixed held-out 10 %; an "epoch" is a fixed number of
  iterations of random windows.

Every rank builds the same model from the same seed and draws the same global batch, of
which it trains on its own slice, so variants differ only in how gradients are averaged.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# The digits split is fixed by these.
SPLIT_SEED = 0
TEST_FRACTION = 0.2

CORPUS = Path(__file__).with_name("data") / "charlm.txt"
# Context, width, heads and depth of the language model; iterations per "epoch".
CONTEXT = 64
WIDTH = 64
HEADS = 4
DEPTH = 2
LM_ITERS_PER_EPOCH = 40
LM_VALID_WINDOWS = 64


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers: 38 k parameters, 153 KB of
    float32 gradients per iteration in 8 tensors over 4 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class CharLM(nn.Module):
    """A GPT-style decoder: token and position embeddings, `DEPTH` pre-norm causal
    self-attention blocks of `WIDTH` channels and `HEADS` heads, a linear head. With 107
    characters: 114 k parameters, 456 KB of float32 gradients in 30 tensors."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, DEPTH, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class Workload:
    """A model, a way to draw this rank's slice of each global batch, and an evaluation."""

    name: str
    metric: str  # what `evaluate` reports besides accuracy
    iters_per_epoch: int

    def model(self) -> nn.Module:
        raise NotImplementedError

    def epoch_batches(self, epoch: int, rank: int, world: int):
        """Yields (input, target) of this rank for every iteration of `epoch`."""
        raise NotImplementedError

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(accuracy, loss) on the held-out data."""
        raise NotImplementedError


class Digits(Workload):
    name, metric = "digits", "test loss"

    def __init__(self, batch: int, seed: int, world: int) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        x = (d.images / 16.0).astype(np.float32)[:, None]  # N x 1 x 8 x 8
        xtr, xte, ytr, yte = train_test_split(
            x, d.target, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=d.target
        )
        self.xtr, self.ytr = torch.from_numpy(xtr), torch.from_numpy(ytr)
        self.xte, self.yte = torch.from_numpy(xte), torch.from_numpy(yte)
        self.batch, self.seed = batch, seed
        self.iters_per_epoch = len(self.xtr) // (batch * world)

    def model(self) -> nn.Module:
        return DigitsCNN()

    def epoch_batches(self, epoch: int, rank: int, world: int):
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        perm = torch.randperm(len(self.xtr), generator=g)
        gb = self.batch * world
        for it in range(self.iters_per_epoch):
            idx = perm[it * gb + rank * self.batch : it * gb + (rank + 1) * self.batch]
            yield self.xtr[idx], self.ytr[idx]

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            out = model(self.xte)
            return float((out.argmax(1) == self.yte).float().mean()), float(F.cross_entropy(out, self.yte))


class CharText(Workload):
    name, metric = "charlm", "validation loss (nats/char)"

    def __init__(self, batch: int, seed: int, world: int, iters_per_epoch: int = LM_ITERS_PER_EPOCH) -> None:
        text = CORPUS.read_text(encoding="utf-8")
        chars = sorted(set(text))
        self.vocab = len(chars)
        index = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * 0.9)
        self.train, self.valid = ids[:cut], ids[cut:]
        self.batch, self.seed = batch, seed
        self.iters_per_epoch = iters_per_epoch
        # A fixed, evenly spaced set of validation windows.
        starts = torch.linspace(0, len(self.valid) - CONTEXT - 2, LM_VALID_WINDOWS).long()
        self.vx = torch.stack([self.valid[s : s + CONTEXT] for s in starts])
        self.vy = torch.stack([self.valid[s + 1 : s + CONTEXT + 1] for s in starts])

    def model(self) -> nn.Module:
        return CharLM(self.vocab)

    def epoch_batches(self, epoch: int, rank: int, world: int):
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        gb = self.batch * world
        for _ in range(self.iters_per_epoch):
            starts = torch.randint(0, len(self.train) - CONTEXT - 1, (gb,), generator=g)
            mine = starts[rank * self.batch : (rank + 1) * self.batch]
            x = torch.stack([self.train[s : s + CONTEXT] for s in mine])
            y = torch.stack([self.train[s + 1 : s + CONTEXT + 1] for s in mine])
            yield x, y

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            out = model(self.vx)
            loss = float(self.loss(out, self.vy))
            acc = float((out.argmax(-1) == self.vy).float().mean())
        return acc, loss if math.isfinite(loss) else float("nan")


WORKLOADS = {"digits": Digits, "charlm": CharText}


def make(name: str, batch: int, seed: int, world: int) -> Workload:
    try:
        return WORKLOADS[name](batch, seed, world)
    except KeyError:
        raise SystemExit(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}") from None
