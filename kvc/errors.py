"""Typed errors with stable exit codes.

Every error a user can cause is a `KvcError`; the CLI maps its `exit_code` to the process
exit status and prints the message without a traceback. Anything else is an internal error.
The codes are part of kvc's interface (README, "Exit codes"): never renumber them.
"""

from __future__ import annotations

from dataclasses import dataclass


class KvcError(Exception):
    """Base of every error kvc raises on purpose."""

    exit_code = 1


class UsageError(KvcError):
    """Bad options or arguments."""

    exit_code = 2


@dataclass(eq=False)
class InvalidModelError(KvcError):
    """A model file kvc refuses to read, with where and why.

    `code` is a short stable slug (e.g. ``bin-truncated``) that tests and scripts can match on;
    `file`, `layer` and `expected`/`found` locate the problem for a person.
    """

    code: str
    file: str
    reason: str
    layer: str | None = None
    expected: str | None = None
    found: str | None = None

    exit_code = 3

    def __post_init__(self) -> None:
        super().__init__(str(self))

    def __reduce__(self):  # pickled by its fields (a device compile's process sends it back)
        return (type(self), (self.code, self.file, self.reason, self.layer, self.expected, self.found))

    def __str__(self) -> str:
        where = self.file + (f": {self.layer}" if self.layer else "")
        text = f"{where}: {self.reason}"
        if self.expected is not None or self.found is not None:
            text += f" (expected {self.expected}, found {self.found})"
        return f"{text} [{self.code}]"


class VerificationError(KvcError):
    """A compiled pipeline does not reproduce its reference."""

    exit_code = 4


class DeviceError(KvcError):
    """A device cannot be used (not present, plugin missing, compile refused)."""

    exit_code = 5


class PassError(KvcError):
    """A transformation cannot apply to this model."""

    exit_code = 6


class OutputError(KvcError):
    """The output cannot be written: a full disk, a quota, a file size limit, a read-only or
    forbidden directory. Nothing is published."""

    exit_code = 7


# The most of an OpenVINO message a reason quotes: it echoes what it read (a 5000-digit <dim>
# came back whole).
REASON_CHARS = 500


def openvino_reason(exc: BaseException) -> str:
    """The informative line of an OpenVINO exception: its text nests "Exception from <file>"
    headers around the actual message, which comes last; at most REASON_CHARS of it."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("Exception from")]
    line = lines[-1] if lines else type(exc).__name__
    return line if len(line) <= REASON_CHARS else f"{line[:REASON_CHARS]}... ({len(line)} characters)"


class ComputeError(KvcError):
    """A model computed what no token can be chosen from (a NaN or +Inf logit, or every logit
    -Inf): nothing is output from it."""

    exit_code = 8
