"""``loss.png``: train and validation loss against step, drawn from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


def plot_losses(metrics_path: Path, out: Path, val_points: list[tuple[int, float]] | None = None) -> Path | None:
    """Draw the loss curves; returns the PNG path (None when there is nothing to draw). ``val_points``
    (step, loss) replaces the validation losses found in the metrics, so the final evaluation that
    follows the last step is drawn too."""
    steps, losses, val_steps, vals = [], [], [], []
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        steps.append(m["step"])
        losses.append(m["loss"])
        if "val_loss" in m:
            val_steps.append(m["step"])
            vals.append(m["val_loss"])
    if not steps:
        return None
    if val_points is not None:
        val_steps, vals = [p[0] for p in val_points], [p[1] for p in val_points]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, label="train", linewidth=1)
    if vals:
        ax.plot(val_steps, vals, "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("BluTrain")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
