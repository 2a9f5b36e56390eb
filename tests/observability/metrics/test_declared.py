"""Counters declared once (broker/core/tally.py): each declared counter is on
/metrics as declared, and docs/metrics.md lists every ``skan_*`` family.

The broker scraped here runs every optional part that has metrics (durable
store, routing log, a cluster on a real nats-server, two bridges), so every
family the collector can yield is there.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import time

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import broker
from broker.core import tally
from tests.brokerproc import ROOT
from tests.cluster.natsproc import NatsCluster, cluster_broker
from tests.observability.metrics.httpc import get
from tests.ports import listener_port

DOCS = ROOT / "docs" / "metrics.md"

# Groups on the allow-list have series from the start (the per-group families
# need a sample to show their label names); the bridges dial nothing.
EXTRA = """
[metrics]
groups = ["alpha"]

[[bridges]]
protocol = "hsp"
address = "127.0.0.1:{dead}"
group = "bridged"
backoff_initial = 0.1
backoff_max = 0.3

[[bridges]]
protocol = "eventer"
address = "127.0.0.1:{dead}"
group = "evented"
backoff_initial = 0.1
backoff_max = 0.3
"""


def declaring_classes() -> list[type]:
    """Every attrs class of the broker with a field declared through tally."""
    found = {}
    for info in pkgutil.walk_packages(broker.__path__, "broker."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and attrs.has(obj) and obj.__module__ == info.name
                    and any(tally.declared(obj))):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def declared_families() -> dict[str, tuple[tally.Family, str]]:
    """name -> (family, the class declaring it first); one declaration per name."""
    families: dict[str, tuple[tally.Family, str]] = {}
    for cls in declaring_classes():
        for _, family, _ in tally.declared(cls):
            seen = families.setdefault(family.name, (family, cls.__qualname__))
            assert seen[0] == family, f"{family.name} declared twice, differently: " \
                                      f"{seen[1]} and {cls.__qualname__}"
    return families


def doc_rows() -> dict[str, tuple[str, frozenset[str]]]:
    """The metric tables of docs/metrics.md (a header ``| metric | type |``,
    with or without a ``labels`` column): exposed name -> (type, label names).
    No labels is an empty cell or "—"; a parenthesis lists values, not names."""
    rows: dict[str, tuple[str, frozenset[str]]] = {}
    header: list[str] = []
    for line in DOCS.read_text().splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["metric", "type"]:
            header = cells
            continue
        name = re.fullmatch(r"`(skan_[a-z0-9_]+)`", cells[0])
        if not header or name is None:
            continue
        row = dict(zip(header, cells, strict=False))
        labels = re.sub(r"\([^)]*\)", "", row.get("labels", ""))
        rows[name.group(1)] = (row["type"], frozenset(
            x.strip() for x in labels.split(",")) - {"", "—"})
    return rows


def exposed(text: str) -> dict[str, tuple[str, str, frozenset[str]]]:
    """/metrics text: ``skan_*`` family name (as exposed: counters with
    ``_total``) -> (type, help, label names of its samples)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("skan_"):
            continue
        # Label names show only on samples: this broker gives every family one.
        assert family.samples, f"{family.name} has no sample here"
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        out[name] = (family.type, family.documentation, labels)
    return out


@pytest.fixture(scope="module")
def metrics_text() -> str:
    dead = listener_port()  # nothing listens: the bridges stay down and retry
    with (NatsCluster(1) as nats,
          cluster_broker(1, nats.nodes[0].url, extra=EXTRA.format(dead=dead)) as proc):
        deadline = time.monotonic() + 10
        while True:
            text = trio.run(get, proc.addr["metrics"], "/metrics").body.decode()
            if "skan_cluster_up 1.0" in text or time.monotonic() > deadline:
                return text
            time.sleep(0.1)


def test_the_broker_declares_counters_in_every_converted_component():
    names = {cls.__qualname__ for cls in declaring_classes()}
    assert {"Counters", "StoreStats", "RoutelogStats", "BackplaneStats", "BridgeStatus",
            "Peers", "ClusterLink"} <= names, names


def test_every_declared_counter_is_on_metrics_as_declared(metrics_text):
    series = exposed(metrics_text)
    assert "skan_cluster_up 1.0" in metrics_text  # the cluster part ran
    for name, (family, where) in declared_families().items():
        shown = f"{name}_total" if family.kind == tally.COUNTER else name
        assert shown in series, f"{where}.{name} is declared but not on /metrics"
        kind, doc, labels = series[shown]
        assert (kind, doc) == (family.kind, family.doc), shown
        assert set(family.labels) <= labels, shown


def test_docs_list_every_family_the_collector_yields(metrics_text):
    series = exposed(metrics_text)
    rows = doc_rows()
    undocumented = sorted(set(series) - set(rows))
    assert not undocumented, f"on /metrics but not in docs/metrics.md: {undocumented}"
    for name, (kind, _, labels) in series.items():
        assert rows[name] == (kind, labels), f"docs/metrics.md row of {name}"
    # This broker runs every part that has metrics: a row it does not yield is stale.
    assert not set(rows) - set(series), sorted(set(rows) - set(series))


def test_fields_feeding_one_series_add_up_and_a_class_reads_zero():
    family = tally.Family(tally.COUNTER, "skan_test_things", "Things.", labels=("side",))

    @attrs.define
    class Stats:
        left: int = family.field("l")
        also_left: int = family.field("l")
        right: int = family.field("r")
        plain: int = 0
        named: int = tally.gauge("skan_test_level", "A level.")

    stats = Stats(left=2, also_left=3, right=5, plain=7, named=11)
    got = [(s.family.name, s.labels, s.value) for s in tally.described(stats)]
    assert got == [("skan_test_things", ("l",), 2), ("skan_test_things", ("l",), 3),
                   ("skan_test_things", ("r",), 5), ("skan_test_level", (), 11)]
    assert [s.value for s in tally.described(Stats)] == [0, 0, 0, 0]
    # The exporter adds the two "l" fields into one series.
    from broker.observability.metrics import _declared
    (metric, level) = _declared([(stats, ())])
    assert [(s.name, s.labels, s.value) for s in metric.samples] == [
        ("skan_test_things_total", {"side": "l"}, 5), ("skan_test_things_total", {"side": "r"}, 5)]
    assert level.type == "gauge" and level.samples[0].value == 11
    with pytest.raises(ValueError):
        family.field()  # one value per label


def test_a_declared_counter_stays_a_plain_slot_attribute():
    """The hot path bumps these like any attribute: no property, no descriptor of ours."""
    from broker.core.counters import Counters
    assert type(Counters.__dict__["undeliverable"]).__name__ == "member_descriptor"
    c = Counters()
    c.undeliverable += 1
    assert c.undeliverable == 1
