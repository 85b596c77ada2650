"""kvc: stateful OpenVINO LLMs to static-shape NPU models, with proof they compute the same thing.

The subpackages are the architecture: `kvc.ir` (load, save, text, diff, graph, KV layout),
`kvc.passes` (graph transformations and the pass manager), `kvc.runtime` (numpy reference
interpreter, sessions, pipelines) and `kvc.cli` (the `kvc` command).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvc")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

from kvc.errors import (  # noqa: E402  (re-exported API)
    DeviceError,
    InvalidModelError,
    KvcError,
    PassError,
    UsageError,
    VerificationError,
)

__all__ = [
    "__version__",
    "KvcError",
    "UsageError",
    "InvalidModelError",
    "PassError",
    "VerificationError",
    "DeviceError",
]
