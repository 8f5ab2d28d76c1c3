"""Plot a run's reward and KL against step from ``run.dir/metrics.jsonl`` into ``run.dir/curves.png``.

    python -m megatron_rl.plotting RUN_DIR        # or logging.plot=true in the job config
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_rl.spec.run_files import METRICS_FILE


def load_train_rows(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run folder?")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("phase") in (None, "train")]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG (reward mean with accuracy, and KL, against step); returns its path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from exc
    rows = load_train_rows(run_dir)
    steps = [r["step"] for r in rows]
    fig, (ax_reward, ax_kl) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for key, label in (("reward_mean", "reward mean"), ("accuracy", "accuracy")):
        if any(key in r for r in rows):
            ax_reward.plot(steps, [r.get(key) for r in rows], label=label)
    ax_reward.set_ylabel("reward")
    ax_reward.legend(loc="lower right")
    ax_reward.grid(alpha=0.3)
    ax_kl.plot(steps, [r.get("kl", 0.0) for r in rows], color="tab:red")
    ax_kl.set_ylabel("KL to reference")
    ax_kl.set_xlabel("GRPO step")
    ax_kl.grid(alpha=0.3)
    fig.suptitle(f"{Path(run_dir).name}")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m megatron_rl.plotting RUN_DIR [OUT.png]", file=sys.stderr)
        return 2
    try:
        print(plot_run(*argv))
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
