"""How a `pdflash` command fails: `UserError`, one line for stderr, and the exit codes.

Owns the EXIT_* codes (listed in docs/cli.md) and the error a command raises for a user's
mistake; `pdflash.cli.parser` turns it into `pdflash: MESSAGE` and the code.
"""

from __future__ import annotations

EXIT_USAGE = 2  # a bad flag or value (argparse's code too)
EXIT_MODEL = 3  # a checkpoint, config or generation_config that cannot be used
EXIT_FILE = 4  # a file or directory that is missing, already exists or cannot be written
EXIT_ADDRESS = 5  # serve: the host/port cannot be bound
EXIT_DEVICE = 6  # the torch device does not exist in this build / on this machine
EXIT_INTERRUPTED = 130  # Ctrl+C (128 + SIGINT), quietly
EXIT_BROKEN_PIPE = 141  # stdout closed early (`| head`; 128 + SIGPIPE), quietly


class UserError(Exception):
    """One line for stderr and its exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code
