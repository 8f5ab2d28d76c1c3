"""The run folder's file names and the job's exit codes: what the job writes and the launcher reads.

A run folder is a ``run.dir``. The launcher writes ``config.yaml`` (and ``prediction.json``, the planner's
prediction for the job's own layout); the job writes ``metrics.jsonl`` (one JSON line a step) and the audit record
``manifest.json`` (``megatron_rl/runtime/manifest.py``).
"""

CONFIG_FILE = "config.yaml"
"""The resolved config, as the launcher wrote it (``${oc.env:...}`` references left unresolved)."""
METRICS_FILE = "metrics.jsonl"
"""One JSON line per step, written by rank 0."""
MANIFEST_FILE = "manifest.json"
"""The run's audit record, written by the job."""
PREDICTION_FILE = "prediction.json"
"""The planner's prediction for the job's own layout, written by ``launch.py`` beside the config."""

REQUEUE_EXIT_CODE = 3
"""A trainer exits with this code after saving a preemption checkpoint; the job script then requeues the job."""
