"""``python launch.py status RUN_DIR [--json]``: state, step/steps, last metrics, ETA and log paths of a run, or of
every stage of a pipeline folder (launcher/runs/status.py)."""

from __future__ import annotations

from launcher.cli import CliParser


def main(argv: list[str]) -> int:
    from launcher.runs.status import folder_status, format_status, status_json

    parser = CliParser(prog="launch.py status", description="show the state of a run or a pipeline")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (run.dir) or a pipeline folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    status = folder_status(args.run_dir)
    print(status_json(status) if args.json else format_status(status))
    return 0
