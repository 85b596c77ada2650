"""JSON text kvc reads from files a user can hand it (manifests, configs, plans, prompts,
goldens, workloads): `loads` is `json.loads` with nesting too deep for the parser (Python's
json recurses: 100000 nested brackets raise RecursionError, which no caller catches, and kvc
exited 1, "internal error") reported as the JSONDecodeError its callers already turn into
a clear error naming the file; so is an integer of more digits than Python converts (4300: a
ValueError, exit 1 in every reader but two)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

# The largest JSON file kvc reads (configs, records, plans: a few KB; a tokenizer.json tens of MB).
MAX_BYTES = 1 << 28


def loads(text: str | bytes):
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("arrays or objects nested too deeply", "", 0) from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        raise json.JSONDecodeError(f"a value Python cannot hold ({str(exc)[:80]})", "", 0) from None


def read_text(path: str | Path) -> str:
    """A JSON file's text, read only from a regular file of at most MAX_BYTES: a FIFO in its
    place (config.json, a blob cache record) hung kvc at its read, and /dev/zero would fill
    memory. Anything else is an OSError naming the path, which readers already report."""
    path = Path(path)
    mode = os.stat(path)
    if not stat.S_ISREG(mode.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    if mode.st_size > MAX_BYTES:
        raise OSError(errno.EFBIG, f"larger than the {MAX_BYTES} bytes kvc reads", str(path))
    return path.read_text(encoding="utf-8")
