"""Which samples each step trains on, and its random numbers: both a pure function of (seed, step).

So a run resumed at step k draws exactly what the uninterrupted run drew at step k, with no RNG
state to carry in the checkpoint. A batch holds samples of one bucket (one shape); every epoch
shuffles each bucket and then the order of the batches.
"""

from __future__ import annotations

import math

import torch

from .objective import Batch
from .prepare import PreparedData, PreparedSample

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constants: distinct (seed, step) pairs give distinct seeds
_MIX2 = 0xBF58476D1CE4E5B9


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    mixed = (seed * _MIX + (step + 1) * _MIX2 + stream) % (1 << 63)
    return torch.Generator("cpu").manual_seed(mixed)


class BatchOrder:
    def __init__(self, data: PreparedData, batch_size: int, seed: int) -> None:
        self.data, self.batch_size, self.seed = data, batch_size, seed
        groups: dict[str, list[PreparedSample]] = {}
        for sample in data.samples:
            groups.setdefault(sample.bucket.label(), []).append(sample)
        self.groups = [groups[label] for label in sorted(groups)]
        self.per_epoch = sum(math.ceil(len(g) / batch_size) for g in self.groups)
        self._epoch: tuple[int, list] = (-1, [])

    def samples(self, step: int) -> list[PreparedSample]:
        epoch, index = divmod(step, self.per_epoch)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, self._batches(epoch))
        return self._epoch[1][index]

    def batch(self, step: int) -> Batch:
        loaded = [self.data.load(sample) for sample in self.samples(step)]
        return Batch(torch.stack([latent for latent, _ in loaded]), torch.stack([embeds for _, embeds in loaded]))

    def _batches(self, epoch: int) -> list[list[PreparedSample]]:
        generator = step_generator(self.seed, epoch, stream=1)
        batches = []
        for group in self.groups:
            order = torch.randperm(len(group), generator=generator).tolist()
            shuffled = [group[i] for i in order]
            batches += [shuffled[i : i + self.batch_size] for i in range(0, len(shuffled), self.batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
