"""Where the command line prints: stdout for results, stderr for progress and errors."""

from __future__ import annotations

import sys

from rich.console import Console

# Piped output (logs, CI) gets a wide table instead of rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
