"""The `pdflash` command line: generate, serve, bench, simulate, train-drafter, make-tiny."""

from pdflash.cli.errors import (
    EXIT_ADDRESS,
    EXIT_BROKEN_PIPE,
    EXIT_DEVICE,
    EXIT_FILE,
    EXIT_INTERRUPTED,
    EXIT_MODEL,
    EXIT_USAGE,
    UserError,
)
from pdflash.cli.options import engine_options
from pdflash.cli.parser import build_parser, main
from pdflash.cli.serve import API_KEY_ENV, server_settings

__all__ = [
    "API_KEY_ENV",
    "EXIT_ADDRESS",
    "EXIT_BROKEN_PIPE",
    "EXIT_DEVICE",
    "EXIT_FILE",
    "EXIT_INTERRUPTED",
    "EXIT_MODEL",
    "EXIT_USAGE",
    "UserError",
    "build_parser",
    "engine_options",
    "main",
    "server_settings",
]
