"""`python -m saccade.cli ...`, the same as `saccade ...`."""

import sys

from saccade.cli import main

sys.exit(main())
