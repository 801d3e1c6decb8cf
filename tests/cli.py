"""What the CLI tests share: a command's exit status and the PNG signature its plots must start with."""

from __future__ import annotations

from collections.abc import Callable

PNG = b"\x89PNG\r\n\x1a\n"


def exit_status(main: Callable[[list[str]], int], args: list[str]) -> int:
    """The CLI's exit status, whether main returns it or argparse exits with it."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code
