"""The `kvc` command: a thin click layer over the library.

Commands parse their options, call `kvc.*`, and render. Expected failures are `KvcError`s:
they print one clear message and exit with the error's code (README, "Exit codes"); only
`--debug` shows a traceback. Ctrl-C exits 130 ("kvc: interrupted"), SIGTERM 143 and SIGHUP
129, each after undoing what was half-written (a second Ctrl-C is ignored while it undoes);
anything else is an internal error (exit 1).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import click

from kvc import __version__
from kvc.errors import KvcError

INTERNAL_ERROR = 1
INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
# SIGTERM (a CI timeout, systemd, `docker stop`, `kill`) and SIGHUP (the terminal closed) stop
# kvc as Ctrl-C does, undoing what was half-written, and exit 128 + the signal's number.
STOPPING = {signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}
STOPPED = {INTERRUPTED} | {128 + int(s) for s in STOPPING}


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread where Ctrl-C raises KeyboardInterrupt, so
    that the same unwinding runs (a compile's unpublished output removed, its child killed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    """The first stop signal unwinds; those after it are ignored, so that the undoing runs to
    its end: a second Ctrl-C, as a user presses one when the first seems slow, interrupted it
    and left the unpublished `.OUT.partial-*` beside OUT or a traceback (1 time in 10 with
    Ctrl-C sent every few ms). kvc exits as soon as the unwinding is done (`main`)."""
    for other in (signal.SIGINT, *STOPPING):
        signal.signal(other, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


class KvcGroup(click.Group):
    """Runs a command and turns errors into messages and exit codes."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt as exc:  # Ctrl-C: not a bug; what was being written is already removed
            signum = getattr(exc, "signum", None)
            click.echo(f"kvc: {STOPPING[signum]} ({signal.Signals(signum).name})" if signum else "kvc: interrupted",
                       err=True)
            ctx.exit(128 + signum if signum else INTERRUPTED)
        except BrokenPipeError:  # `kvc ... | head`: the reader left; that is not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except KvcError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            click.echo(f"kvc: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except Exception as exc:  # noqa: BLE001  (the last line of defence)
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            else:
                click.echo(f"kvc: internal error: {type(exc).__name__}: {exc}\n"
                           "(run again with --debug for a traceback)", err=True)
            ctx.exit(INTERNAL_ERROR)


@click.group(cls=KvcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvc")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """kvc: compile stateful OpenVINO LLMs into static-shape NPU models, and verify them."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _register() -> None:
    from kvc.cli.bisect_cmd import bisect
    from kvc.cli.compile_cmd import compile_
    from kvc.cli.diff_cmd import diff
    from kvc.cli.inspect_cmd import inspect
    from kvc.cli.passes_cmd import passes
    from kvc.cli.plan_cmd import plan
    from kvc.cli.report_cmd import report
    from kvc.cli.run_cmd import run
    from kvc.cli.verify_cmd import verify

    for command in (compile_, run, verify, bisect, diff, inspect, passes, report, plan):
        cli.add_command(command)


_register()


def main() -> None:
    """The `kvc` program. Interrupted, it leaves at once once its output is flushed
    (`os._exit(130)`): what the interrupted work had to undo was undone as the interrupt
    unwound (the unpublished output removed, the device compile's child killed), but threads it
    left may still be inside OpenVINO (the thread awaiting the device compiles, the plugin's
    workers), and the interpreter's normal exit then destroyed C++ objects under them: about
    one Ctrl-C in fifteen at the start of the device compiles ended in "terminate called
    without an active exception" (SIGABRT) after "kvc: interrupted", not exit 130."""
    for signum in (signal.SIGINT, *STOPPING):
        signal.signal(signum, _stop)
    try:
        cli(prog_name="kvc")
    except SystemExit as exc:
        if exc.code in STOPPED:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.code)
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
