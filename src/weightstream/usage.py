"""The one-line usage error of every `weightstream` command line: `OneLineParser` and its exit status.

Both `weightstream` (`cli.py`) and `weightstream bench` (`bench/cli.py`) parse with it, so a mistake in
what was asked ends the same way everywhere: one line on stderr, naming where the options are listed,
exit status 2.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

USAGE_ERROR = 2  # the exit status of a mistake in what was asked


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage mistakes (an unknown option, a value of the wrong type, a missing argument)
    end like every other mistake: one line on stderr, naming where the options are listed, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see: {self.prog} --help)\n")
