"""``python launch.py logs RUN_DIR [--follow] [--rank N]``: print a rank's log (a Slurm run's batch log first),
and with --follow keep printing as it grows until the run ends; ``--samples``: the completions of the latest
step in samples.jsonl (launcher/runs/logs.py)."""

from __future__ import annotations

from launcher.cli import CliParser


def main(argv: list[str]) -> int:
    from launcher.runs.logs import print_logs, print_samples

    parser = CliParser(prog="launch.py logs", description="print a run's logs (rank 0 by default)")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (run.dir)")
    parser.add_argument("--rank", type=int, default=0, metavar="N", help="the rank whose log to print (default 0)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the run ends "
                        "(Ctrl-C stops, exit 130)")
    parser.add_argument("--samples", action="store_true", help="print the completions of the latest step in "
                        "samples.jsonl (GRPO and PPO, every logging.sample_every steps) instead of a log")
    args = parser.parse_args(argv)
    if args.samples:
        if args.follow:
            parser.error("--samples prints the latest samples once; leave out --follow")
        return print_samples(args.run_dir)
    return print_logs(args.run_dir, rank=args.rank, follow=args.follow)
