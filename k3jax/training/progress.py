"""What a run shows and leaves behind as it goes: OUT/metrics.jsonl (one line per optimizer step), a tqdm
bar on stderr, and OUT/loss.png (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from matplotlib.figure import Figure
from tqdm import tqdm


class MetricsLog:
    """Appends one JSON line per step to `path`, flushed at once so that a killed run loses no finished step.
    `truncate(step)` drops the lines after `step` (a resumed run rewrites them exactly)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def truncate(self, step: int) -> None:
        """Keep the lines of steps <= `step` (a partly written last line is dropped too)."""
        self._file.close()
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a final line cut short by a kill is skipped."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class ProgressBar:
    """A tqdm bar over optimizer steps with loss, tokens/s and ETA (tqdm's), or nothing when disabled."""

    def __init__(self, total: int, start: int, *, enabled: bool) -> None:
        self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, disable=not enabled)

    def update(self, loss: float, tokens_per_s: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window < 2:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_losses(records: Iterable[dict[str, Any]], png: Path, *, title: str = "fine-tuning loss") -> Path:
    """Training loss per step (and its moving average), eval loss where measured, to `png`."""
    records = list(records)
    steps = np.array([r["step"] for r in records])
    loss = np.array([r["loss"] for r in records], dtype=np.float64)
    # A bare Figure renders with Agg on its own: no pyplot, so the global backend (a notebook's inline
    # plots, a user's display) is left alone.
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=1, label="train loss")
    window = max(1, len(loss) // 20)
    if window > 1:
        ax.plot(steps[window - 1:], _smooth(loss, window), color="tab:blue", label=f"train, mean of {window}")
    evals = [(r["step"], r["eval_loss"]) for r in records if math.isfinite(r.get("eval_loss", math.nan))]
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:orange", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png
