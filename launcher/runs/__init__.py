"""Read a run folder from the login node: its state, progress and logs, for ``launch.py status|logs|cancel``.

    python launch.py status RUN_DIR [--json]     # folder.py (what the folder holds) -> status.py (the report)
    python launch.py logs RUN_DIR [--follow] [--rank N]     # logs.py
    python launch.py cancel RUN_DIR              # cancel.py

A run folder is a ``run.dir``: it holds ``config.yaml``. A folder without one whose direct subfolders have one
(a pipeline: one run folder per stage) is read stage by stage. None of it imports torch or Megatron.
"""
