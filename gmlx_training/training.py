"""What the training scripts share: a compiled AdamW step with gradient clipping, and a learning-rate
schedule laid over the steps a wall-clock budget allows."""

from __future__ import annotations

import math
from functools import partial
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np


def compiled_step(module: nn.Module, loss_fn, lr: float):
    """(optimizer, step, state): `step(x) -> (loss, parts)` updates `module` in place (AdamW,
    weight decay 0.01, gradients clipped to norm 1); evaluate `state` after each call."""
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.01)
    loss_grad = nn.value_and_grad(module, loss_fn)
    state = [module.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x):
        (loss, parts), grads = loss_grad(x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(module, grads)
        return loss, parts

    return opt, step, state


class BudgetSchedule:
    """Linear warm-up, then cosine to 10% of `lr` over an estimated step count; `reestimate` once
    the first steps are timed, so the decay ends when the wall-clock budget does."""

    def __init__(self, lr: float, warmup: int, est_steps: int):
        self.lr, self.warmup, self.est_steps = lr, warmup, est_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        p = min(1.0, (step - self.warmup) / max(1, self.est_steps - self.warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def reestimate(self, steps_done: int, elapsed_s: float, budget_s: float) -> int:
        self.est_steps = max(self.warmup + 50, int(steps_done / elapsed_s * budget_s))
        return self.est_steps


def batches(n: int, batch: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless batches of `batch` indices into n examples: shuffled epochs back to back (a batch
    may straddle two), for loops that stop on a wall-clock budget rather than an epoch count."""
    order = np.array([], dtype=np.int64)
    while True:
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(n)])
        idx, order = order[:batch], order[batch:]
        yield idx
