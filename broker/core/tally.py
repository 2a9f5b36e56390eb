"""Counters declared once: a component's counter carries its metric name and help.

A counter stays a plain int field of an attrs class (slots): the code that
counts bumps it like any attribute, at the same cost, because the metric is
only attrs field metadata, read at scrape time.  ``commits: int =
counter("skan_store_commits", "Store transactions committed.")`` declares
the field and its metric in one place; :func:`described` walks an object's
declared fields and broker/observability/metrics.py turns them into
Prometheus families, so a new counter is exported by declaring it.

Names are given without Prometheus's ``_total`` suffix (the exposition adds
it to counters).  Every family is listed in docs/metrics.md, which a test
keeps in step with what the collector yields.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

COUNTER = "counter"
GAUGE = "gauge"
# The attrs metadata key of a declared field: (Family, label values).
_KEY = "skan.metric"


@attrs.frozen
class Family:
    """One metric family: kind (:data:`COUNTER` or :data:`GAUGE`), name, help,
    label names.  Several fields may feed one family (one series each, or the
    same series, whose values then add up)."""

    kind: str = attrs.field(validator=attrs.validators.in_((COUNTER, GAUGE)))
    name: str
    doc: str
    labels: tuple[str, ...] = ()

    def field(self, *values: str, default: Any = 0) -> Any:
        """An attrs field (default ``default``) feeding this family's series
        with label values ``values``, one per label name."""
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: label values {values} for labels {self.labels}")
        return attrs.field(default=default, metadata={_KEY: (self, values)})


def counter(name: str, doc: str) -> Any:
    """A plain int field (0) exported as the counter ``name`` (``name_total``)."""
    return Family(COUNTER, name, doc).field()


def gauge(name: str, doc: str) -> Any:
    """A plain int field (0) exported as the gauge ``name``."""
    return Family(GAUGE, name, doc).field()


@attrs.frozen
class Sample:
    family: Family
    labels: tuple[str, ...]
    value: float


def declared(cls: type) -> Iterator[tuple[attrs.Attribute, Family, tuple[str, ...]]]:
    """The declared fields of an attrs class, in declaration order."""
    for field in attrs.fields(cls):
        decl = field.metadata.get(_KEY)
        if decl is not None:
            yield field, decl[0], decl[1]


def described(obj: object) -> Iterator[Sample]:
    """The value of each declared field of ``obj`` (an attrs instance), in
    declaration order.  Given the class instead, each reads 0: a component
    that is not running still has its series, at 0, so the first increase
    is visible to rate() and dashboards draw 0 rather than "no data"."""
    cls = obj if isinstance(obj, type) else type(obj)
    for field, family, values in declared(cls):
        yield Sample(family, values, 0 if obj is cls else getattr(obj, field.name))
