"""The `pdflash` command line: generate, serve, bench, simulate, train-drafter, make-tiny."""

from pdflash.cli.commands import (
    API_KEY_ENV,
    EXIT_ADDRESS,
    EXIT_BROKEN_PIPE,
    EXIT_DEVICE,
    EXIT_FILE,
    EXIT_INTERRUPTED,
    EXIT_MODEL,
    EXIT_USAGE,
    UserError,
    _engine_options,
    server_settings,
)
from pdflash.cli.parser import build_parser, main

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
    "_engine_options",
    "build_parser",
    "main",
    "server_settings",
]
