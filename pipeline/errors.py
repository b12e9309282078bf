"""The errors a command reports in one line, and the one place that reports them.

- `ConfigError`: what the user gave cannot run: a config file or one of its fields, a
  command-line argument, the credentials the config points at. Exit code 2.
- `CommandError`: the process cannot start or go on for a reason its message states: Redis
  unreachable, a port in use, a model that does not load, token ids beyond the model's
  vocabulary. Exit code 1.

`guarded(prog, run, debug=...)` runs a command and turns those into one line on stderr
(`rollstream consumer: ...`), with the traceback above it only under `debug` (`--log-level
DEBUG`). A closed stdout (`rollstream simulate --json | head`) ends the command quietly, and
Ctrl-C with exit code 130. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

USAGE = 2
RUNTIME = 1


class ConfigError(ValueError):
    """A configuration that cannot run; the message names every offending field."""


class CommandError(RuntimeError):
    """A process cannot start or go on; the message says why and what to do, in one line."""


def exit_code(exc: BaseException) -> int | None:
    """The exit code of an error reported in one line; None for any other (a bug)."""
    if isinstance(exc, ConfigError):
        return USAGE
    if isinstance(exc, CommandError):
        return RUNTIME
    return None


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line (a message that quotes a remote traceback keeps its
    first and last lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[0]} ... {lines[-1]}"


def guarded(prog: str, run: Callable[[], int], *, debug: bool = False, config: str | None = None) -> int:
    """`run()`'s exit code; a ConfigError or CommandError is printed as `prog: message`,
    naming the command's `config` file when the message does not already."""
    try:
        return run()
    except BrokenPipeError:
        _quiet_stdout()
        return RUNTIME
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, CommandError) as exc:
        if debug:
            traceback.print_exception(exc)
        line = one_line(exc)
        if config and str(config) not in line:
            line += f" (config {config})"
        print(f"{prog}: {line}", file=sys.stderr)
        return exit_code(exc) or RUNTIME


def _quiet_stdout() -> None:
    """The reader of stdout went away: point stdout at /dev/null, so that the interpreter's
    final flush does not fail again (the recipe of Python's `signal` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
