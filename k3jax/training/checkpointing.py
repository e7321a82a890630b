"""Fine-tuning checkpoints: the trainer's state, the data position and the metrics, under one Orbax step.

    OUT/checkpoints/<step>/state    the Trainer's state pytree (params or adapters, optimizer, step, RNG)
    OUT/checkpoints/<step>/data     the data stream's position (JSON), so a resumed run reads the next batch
    OUT/checkpoints/<step>/metrics  the metrics ranked for "best" (JSON, Orbax's own)

Orbax writes each step to a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoints intact and the partial one ignored. Kept: the `keep` latest
steps and the `keep_best` steps of lowest `best_metric` (Orbax preservation policies), nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

STATE, DATA = "state", "data"


class RunCheckpoints:
    """The checkpoints of one run in `directory` (created if missing)."""

    def __init__(self, directory: str | Path, *, keep: int = 2, keep_best: int = 1, best_metric: str = "loss",
                 async_save: bool = True) -> None:
        if keep < 1 or keep_best < 0:
            raise ValueError(f"keep={keep}, keep_best={keep_best}: expected keep >= 1 and keep_best >= 0")
        self.best_metric = best_metric
        policies = [checkpoint_managers.LatestN(keep)]
        if keep_best:
            # BestN keeps the first n of the steps sorted by the metric; reverse=True puts the lowest first
            policies.append(checkpoint_managers.BestN(get_metric_fn=lambda m: m[best_metric], reverse=True,
                                                      n=keep_best, keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=(STATE, DATA))

    def save(self, step: int, state: Any, *, position: dict[str, Any], metrics: dict[str, float]) -> None:
        """Checkpoint `state` at optimizer step `step` (1-based: the steps taken) with the data position."""
        if self.best_metric not in metrics:
            raise ValueError(f"metrics {sorted(metrics)} lack {self.best_metric!r}, the metric 'best' ranks by")
        self._manager.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                                           DATA: ocp.args.JsonSave(position)}),
                           metrics=metrics, force=True)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """(state, data position) of `step`; `target` is a state pytree of the same structure whose arrays
        give each leaf's shape, dtype and sharding (e.g. a freshly built Trainer's `state()`)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target),
                                                                         DATA: ocp.args.JsonRestore()}))
        return restored[STATE], restored[DATA]

    def wait(self) -> None:
        """Block until an asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
