"""``python -m launcher.cli ...`` is ``python launch.py ...`` (what the Slurm conversion job runs)."""

import sys

from launcher.cli import main

sys.exit(main())
