"""Named rewrite rules: a pattern with a name, a match that says why it failed, and a rewrite.

    SELF_SLOT = Rule("unmask-pad-rows/bool-mask", anchors=("ScaledDotProductAttention",),
                     match=_match, rewrite=_rewrite)

    SELF_SLOT.apply(model.get_ordered_ops())        # match and rewrite, node by node
    found = SELF_SLOT.matches(model.get_ordered_ops())  # match only (rewrite them together later)

`match(node)` returns what the rewrite needs, or raises `NoMatch(reason)`; it runs only on
nodes whose type is one of `anchors` (and that `where` admits, when given), and must not
change the model. `rewrite(match)` edits
the model. A rule is named `<pass>/<pattern>`.

Every match attempt is recorded while a PassManager runs the pass: hits per rule go into its
PassRecord (and the dump's index.json), and with `--debug-rules` (KVC_DEBUG_RULES=1) each
miss is printed with the node and the reason, which is how a user finds why a model's
pattern was not rewritten. Outside a PassManager nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import openvino as ov

from kvc.passes.framework.base import describe_node


class NoMatch(Exception):
    """Why a rule does not match at a node (recorded, never shown to a user as an error)."""


@dataclass
class RuleLog:
    """What the rules of one pass run did: hits per rule, and each miss with its reason."""

    hits: Counter = field(default_factory=Counter)
    misses: list[tuple[str, str, str]] = field(default_factory=list)  # (rule, node, reason)

    def hit_counts(self) -> dict[str, int]:
        return dict(sorted(self.hits.items()))


_ACTIVE: contextvars.ContextVar[RuleLog | None] = contextvars.ContextVar("kvc_rule_log", default=None)


@contextlib.contextmanager
def recording() -> Iterator[RuleLog]:
    """Record every rule's hits and misses until the block ends (the PassManager does this)."""
    log = RuleLog()
    token = _ACTIVE.set(log)
    try:
        yield log
    finally:
        _ACTIVE.reset(token)


@dataclass(frozen=True)
class Rule:
    name: str
    anchors: tuple[str, ...]
    match: Callable[[ov.Node], Any]
    rewrite: Callable[[Any], None] | None = None
    # For a rule anchored on a type every model has hundreds of (Constant): the nodes of the
    # anchor types it is about; the others are no candidates, and no miss is recorded for them.
    where: Callable[[ov.Node], bool] | None = None

    def try_match(self, node: ov.Node) -> Any | None:
        """The match at `node`, or None (a miss, recorded with its reason)."""
        if node.get_type_name() not in self.anchors or (self.where is not None and not self.where(node)):
            return None
        log = _ACTIVE.get()
        try:
            found = self.match(node)
        except NoMatch as why:
            if log is not None:
                log.misses.append((self.name, describe_node(node), str(why)))
            return None
        if log is not None:
            log.hits[self.name] += 1
        return found

    def matches(self, nodes: Iterable[ov.Node]) -> list[Any]:
        """Every match among `nodes`, in their order."""
        return [m for m in (self.try_match(n) for n in nodes) if m is not None]

    def apply(self, nodes: Iterable[ov.Node]) -> int:
        """Match and rewrite each node in turn; how many were rewritten."""
        if self.rewrite is None:
            raise TypeError(f"rule {self.name} has no rewrite; use matches()")
        count = 0
        for node in list(nodes):
            found = self.try_match(node)
            if found is not None:
                self.rewrite(found)
                count += 1
        return count


__all__ = ["Rule", "NoMatch", "RuleLog", "recording"]
