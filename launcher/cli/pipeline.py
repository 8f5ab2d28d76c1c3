"""``python launch.py pipeline [--config FILE] [--dry-run] [--wait] [key=value ...]``: run the stages of a
pipeline file (SFT -> RM -> GRPO -> eval ...) in order locally, or submit them chained with afterok on Slurm
(launcher/pipeline.py documents the file, its ``${stages.NAME.checkpoint}`` references and the overrides).

    python launch.py pipeline --config configs/pipeline_tiny.yaml
    python launch.py pipeline --config configs/pipeline_tiny.yaml cluster.executor=slurm stages.grpo.run.steps=50
"""

from __future__ import annotations

import argparse

from launcher.cli import CliParser


def main(argv: list[str]) -> int:
    from launcher.pipeline import run_pipeline

    parser = CliParser(prog="launch.py pipeline", description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", default="pipeline_tiny", help="pipeline file, or the name of "
                        "a shipped one (default: pipeline_tiny: SFT -> RM -> GRPO -> eval on the tiny CPU task)")
    parser.add_argument("--dry-run", action="store_true", help="print every stage's resolved config, its plan and "
                        "the dependency chain; start nothing")
    parser.add_argument("--wait", action="store_true", help="Slurm: follow the stages' jobs in order until the "
                        "last ends (local pipelines always wait)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="pipeline.dir=DIR, "
                        "stages.NAME.section.key=value (one stage) or section.key=value (every stage)")
    args = parser.parse_intermixed_args(argv)
    return run_pipeline(args.config, args.overrides, dry_run=args.dry_run, wait=args.wait)
