"""The training monitor: one JSON line per logged step (and per evaluation), TensorBoard scalars,
and a loss-curve PNG at the end. Only rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
# Written into the output directory after the model: its presence means the export is complete.
SUMMARY_FILE = "training_summary.json"


class Monitor:
    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool, resumed_step: int) -> None:
        self.path = out_dir / METRICS_FILE
        self._enabled = enabled
        self._writer = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        # Lines past the resumed step came from the attempt that crashed after its last checkpoint;
        # the resumed run recomputes those steps, so the curve must not show them twice.
        self._truncate_after(resumed_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resumed_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict[str, Any]) -> None:
        """Append `record` (which has a "step"); numbers also go to TensorBoard."""
        if not self._enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: Path, png_path: Path) -> None:
    """Training loss per step and validation loss where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, axis = plt.subplots(figsize=(7, 4))
    if train:
        axis.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        axis.plot(*zip(*val), "o-", label="validation loss")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats/token)")
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
