#!/usr/bin/env python3
"""Launch Megatron-Core RL post-training from a login node (or a laptop).

    python launch.py                       # default: GRPO on a tiny model, 2 local CPU processes
    python launch.py --help                # options, subcommands (plan, convert) and examples
"""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
