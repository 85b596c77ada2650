"""JSON text kvc reads from files a user can hand it (manifests, configs, plans, prompts,
goldens, workloads): `loads` is `json.loads` with nesting too deep for the parser (Python's
json recurses: 100000 nested brackets raise RecursionError, which no caller catches, and kvc
exited 1, "internal error") reported as the JSONDecodeError its callers already turn into
a clear error naming the file; so is an integer of more digits than Python converts (4300: a
ValueError, exit 1 in every reader but two)."""

from __future__ import annotations

import json


def loads(text: str | bytes):
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("arrays or objects nested too deeply", "", 0) from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        raise json.JSONDecodeError(f"a value Python cannot hold ({str(exc)[:80]})", "", 0) from None
