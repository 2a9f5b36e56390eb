"""The Grafana files hang together: ids, data sources, variables, provisioning paths."""

from __future__ import annotations

import importlib.util
import json
import re

from tests.brokerproc import ROOT

GRAFANA = ROOT / "grafana"


def _dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "skan-broker.json").read_text())


def test_panels_are_well_formed():
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "job", "instance"}
    for panel in dash["panels"]:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= variables | {"__rate_interval"}, (panel["title"], used)
            # Every series is narrowed to the chosen job and instance.
            for selector in re.findall(r"\b[a-z_]+\{([^}]*)\}", target["expr"]):
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector


def test_panels_do_not_overlap():
    cells = set()
    for panel in _dashboard()["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
        assert g["x"] + g["w"] <= 24


def test_provisioning_points_at_the_dashboard_and_datasource():
    provider = (GRAFANA / "provisioning" / "dashboards" / "skan.yaml").read_text()
    assert "type: file" in provider and "path: /var/lib/grafana/dashboards/skan" in provider
    datasource = (GRAFANA / "provisioning" / "datasources" / "skan-prometheus.yaml").read_text()
    assert "type: prometheus" in datasource and "uid: skan-prometheus" in datasource
    readme = (GRAFANA / "README.md").read_text()
    assert "/var/lib/grafana/dashboards/skan" in readme


def _generator():
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_dashboard_is_the_generator_output():
    """grafana/dashboards/skan-broker.json is exactly what grafana/generate.py writes."""
    generate = _generator()
    assert generate.OUTPUT == GRAFANA / "dashboards" / "skan-broker.json"
    assert generate.render() == generate.OUTPUT.read_text(), (
        "the dashboard JSON is out of date: run python grafana/generate.py")
    assert generate.main(["--check"]) == 0


def test_bridge_panels_have_a_value_without_bridges():
    """Every bridge query falls back to a series of its own when no bridge exists."""
    bridge_panels = [p for p in _dashboard()["panels"]
                     if p["type"] != "row" and "skan_bridge_" in json.dumps(p["targets"])]
    assert len(bridge_panels) == 4
    for panel in bridge_panels:
        for target in panel["targets"]:
            assert re.search(r' or on\(\) label_replace\(vector\(-?\d\), "bridge", "none"',
                             target["expr"]), (panel["title"], target["expr"])
