"""``python launch.py cancel RUN_DIR``: scancel a run's pending or running Slurm jobs (every stage of a pipeline
folder), or stop a local run's launcher (launcher/runs/cancel.py)."""

from __future__ import annotations

from launcher.cli import CliParser


def main(argv: list[str]) -> int:
    from launcher.runs.cancel import cancel_folder

    parser = CliParser(prog="launch.py cancel", description="cancel a run or every stage of a pipeline")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (run.dir) or a pipeline folder")
    args = parser.parse_args(argv)
    for line in cancel_folder(args.run_dir):
        print(line)
    return 0
