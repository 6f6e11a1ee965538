"""`python -m saccade ...` (what torchrun starts: `torchrun --nproc-per-node N -m saccade rl CONFIG`)."""

import sys

from saccade.cli import main

sys.exit(main())
