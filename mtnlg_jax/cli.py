"""The command-line contract every launch script keeps: bad input is one line, exit status 2.

    error: <what is wrong, naming the flag, key or file>

It prints before anything is compiled or written, so a mistyped command costs nothing.
"""

import argparse
import sys


def fail(message):
    """Print `error: message` to stderr and exit with status 2."""
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (not usage text) and exit 2."""

    def error(self, message):
        fail(message)
