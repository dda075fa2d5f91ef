"""Rules every kernel family can carry beyond its index terms, and the search for a family's limit.

An :class:`~safe_ops.families.envelope.Envelope` is data: index terms on the call's roles (evaluated by
``envelope.check``) plus ``extra_rules``, callables ``rule(call) -> [Violation]`` for limits
that are not index arithmetic. The rule classes here are the shared ones, used by any family:

* :class:`KvLenRule` -- an evidence-based key-length limit (rule "length": key/value chunks
  can satisfy it, for kernels that return their LSE).

:func:`first_unsafe` finds where a family's envelope first refuses a growing call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .envelope import AttnCall, Envelope, Violation, check


@dataclass(frozen=True)
class KvLenRule:
    """Evidence-based length limit (not index arithmetic)."""
    family: str
    max_exclusive: int
    cite: str
    why: str

    def __call__(self, call: AttnCall) -> list[Violation]:
        if call.kv_len >= self.max_exclusive:
            return [Violation(self.family, "length",
                              f"kv_len {call.kv_len:,} >= {self.max_exclusive:,}: {self.why}",
                              value=call.kv_len, limit=self.max_exclusive - 1, cite=self.cite)]
        return []


def first_unsafe(env: Envelope, make_call: Callable[[int], AttnCall], lo: int, hi: int,
                 rules: tuple[str, ...] | None = None) -> int | None:
    """Smallest n in (lo, hi] with a violation (of ``rules`` if given), assuming ``lo`` is
    safe and violations are monotone in n. None when ``hi`` is still safe."""
    def bad(n: int) -> bool:
        vs = check(make_call(n), env)
        return any(rules is None or v.rule in rules for v in vs)
    if not bad(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bad(mid):
            hi = mid
        else:
            lo = mid
    return hi
