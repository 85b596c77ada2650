"""Running the kvc command line in-process, for the CLI-level tests."""

from __future__ import annotations

from click.testing import CliRunner

from kvc.cli.main import cli

# A small static plan for compiles that only need to be quick.
SMALL = ["--max-prompt-len", "64", "--min-response-len", "64"]


def kvc(*args, code: int = 0):
    """Run `kvc ARGS`; assert its exit code, return click's result."""
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, f"exit {result.exit_code}, expected {code}\n{result.output}"
    return result
