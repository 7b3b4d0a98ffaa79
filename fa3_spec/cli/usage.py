"""What the subcommands share: the usage error (exit 2, one line) and argument types."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UsageError(ValueError):
    """An invalid invocation or configuration: exit status 2, one line, no traceback."""


def usage_exit(command: str, problem: object) -> NoReturn:
    """Print ``fa3-spec COMMAND: error: PROBLEM`` (one line) to stderr and exit
    with status 2, as argparse does for the errors it finds itself."""
    text = " ".join(str(problem).split())
    print(f"fa3-spec {command}: error: {text}", file=sys.stderr)
    raise SystemExit(2)


def at_least(minimum: int):
    """argparse type: an int >= ``minimum`` (a usage error otherwise, not a crash later)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"  # argparse names the type in its message
    return parse


def non_negative(kind):
    """argparse type: a finite ``kind`` (int or float) >= 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} >= 0"
    return parse


def check_writable(flag: str, path: str) -> None:
    """Raise `UsageError` naming ``flag`` unless ``path`` can be written: checked
    before a run, so that its results are not lost after it."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path!r}: the directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path!r} is not writable")


def check_compile_backend(flag: str, name: str) -> str:
    """``name`` if ``torch.compile`` knows that backend, else `UsageError` naming
    ``flag`` and the known ones."""
    import torch

    known = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if name not in known:
        raise UsageError(f"{flag} must be a torch.compile backend (aot_eager, eager, inductor, "
                         f"or another of torch._dynamo.list_backends()); got {name!r}")
    return name
