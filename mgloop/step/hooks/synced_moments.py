"""`--batch_norm=sync` as a hook: each tower's forward pass is traced inside its side of
the cross-tower moments (sync_batch_norm.py), each step with fresh collective keys."""

from __future__ import annotations

from mgloop.step import sync_batch_norm
from mgloop.step.hooks import Hook


class SyncBatchNorm(Hook):
    def __init__(self, tower_devices: list[str]):
        self.moments = sync_batch_norm.CrossTowerMoments(tower_devices)

    def step_scope(self):
        return self.moments.step()

    def tower_scope(self, t):
        return self.moments.tower(t)
