"""The run folder's file names and the job's exit codes: what the job writes and the launcher reads.

A run folder is a ``run.dir``. The launcher writes ``config.yaml`` (and ``prediction.json``, the planner's
prediction for the job's own layout); the job writes ``metrics.jsonl`` (one JSON line a step), ``samples.jsonl`` (a few completions of some RL steps)
and the audit record
``manifest.json`` (``megatron_rl/runtime/manifest.py``).
"""

from pathlib import Path

CONFIG_FILE = "config.yaml"
"""The resolved config, as the launcher wrote it (``${oc.env:...}`` references left unresolved)."""
BUILTIN_TOKENIZER_NAMES = ("builtin:char-ascii", "builtin:char-arabic")
"""The character tokenizers ``model.tokenizer`` may name (``megatron_rl/data/tokenizer.py`` builds them); null is
the first."""
METRICS_FILE = "metrics.jsonl"
"""One JSON line per step, written by rank 0."""
SAMPLES_FILE = "samples.jsonl"
"""Completions of every ``logging.sample_every``-th RL step, one JSON line each, written by rank 0."""
MANIFEST_FILE = "manifest.json"
"""The run's audit record, written by the job."""
EVAL_FILE = "eval.json"
"""Held-out evaluations (``algorithm.name=eval``), one entry per eval.stage, written by the eval trainer."""
PREDICTION_FILE = "prediction.json"
"""The planner's prediction for the job's own layout, written by ``launch.py`` beside the config."""

REQUEUE_EXIT_CODE = 3
"""A trainer exits with this code after saving a preemption checkpoint; the job script then requeues the job (and
ends with it when the job was requeued too often, slurm/train.sbatch)."""
GATE_EXIT_CODE = 4
"""The eval trainer exits with this code when eval.min_pass_at_1 is missed: not a failure of the job's machinery,
and never taken for a preemption."""
JOB_EXIT_CODES = {0: "done", 1: "a rank failed", 2: "a config error (ConfigError)", REQUEUE_EXIT_CODE: "preempted: "
                  "checkpoint saved, requeue", GATE_EXIT_CODE: "the evaluation gate (eval.min_pass_at_1) was missed"}
"""Every code a job ends with, and what it means; distinct by construction (tests/test_sbatch_render.py checks the
job script's literals against them)."""


def builtin_tokenizer(path: str | None) -> str | None:
    """The built-in tokenizer that ``model.tokenizer=path`` loads (null: builtin:char-ascii), or None for a folder."""
    if path is None:
        return BUILTIN_TOKENIZER_NAMES[0]
    return path if path in BUILTIN_TOKENIZER_NAMES else None


def run_config_of_checkpoint(checkpoint: str) -> Path | None:
    """The ``config.yaml`` of the run that wrote ``checkpoint`` (its checkpoints folder or a step folder in it), when
    it is beside it on this machine; None otherwise (a cluster path, an imported checkpoint)."""
    path = Path(checkpoint).expanduser()
    for folder in (path.parent, path.parent.parent):
        if (folder / CONFIG_FILE).is_file():
            return folder / CONFIG_FILE
    return None
