"""Where the command line prints: stdout for results, stderr for progress and errors."""

from __future__ import annotations

import sys

from rich.console import Console

# Piped output (logs, CI) gets a wide table instead of rich's 80-column default: a chip
# budget's front with a prefix cache column is about 180 columns wide.
PIPED_WIDTH = 200
out = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
err = Console(stderr=True, width=None if sys.stderr.isatty() else PIPED_WIDTH)
