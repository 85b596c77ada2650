"""Graph transformations: one module per pass, a registry, and the PassManager.

Passes are frozen dataclasses whose fields are their options (`kvc.passes.framework.base`); a pipeline
can be written as text (`parse_pipeline("lift-state{beam=keep},fuse-kvcache")`).
"""

from __future__ import annotations

import functools
import importlib

from kvc.passes.framework.base import Pass, PassFailure, PassResult
from kvc.passes.framework.manager import Instrumentation, PassManager, PipelineRun
from kvc.passes.framework.registry import format_pipeline, get_pass, parse_pipeline, registered

PASS_MODULES = ("lift_state", "dense_experts", "fuse_kvcache", "lower_kvcache", "static_shape", "kv_io",
                "mask_positions", "unmask_pad_rows", "group_attention", "rotate_half_rope", "relative_alibi",
                "mlp_rows", "pin_rows", "prompt_end")

# What `kvc compile` runs before static shaping: lift the state into inputs/outputs, give MoE
# expert blocks a static shape, write split-halves rotary as rotate-half and measure ALiBi
# positions from the newest token (each a no-op on models without the pattern).
DEFAULT_PIPELINE = "lift-state,dense-experts,rotate-half-rope,relative-alibi"


@functools.cache
def load_all() -> None:
    """Import every pass module so each registers itself, then the installed plugins."""
    from kvc.passes.framework.plugins import load_entry_points

    for module in PASS_MODULES:
        importlib.import_module(f"kvc.passes.{module}")
    load_entry_points()


def default_pipeline() -> list[Pass]:
    return parse_pipeline(DEFAULT_PIPELINE)


__all__ = ["Pass", "PassResult", "PassFailure", "PassManager", "Instrumentation", "PipelineRun",
           "parse_pipeline", "format_pipeline", "get_pass", "registered", "default_pipeline",
           "DEFAULT_PIPELINE"]
