"""Build grafana/dashboards/skan-broker.json from code (grafana-foundation-sdk).

    python grafana/generate.py           # rewrite the dashboard file
    python grafana/generate.py --check   # exit 1 if the file differs from the code

The committed JSON is this script's output; edit the panels here, run it,
and commit both (tests/observability/metrics/test_dashboard.py fails when
they differ).  Every query narrows its series to the dashboard's Job and
Instance variables through :func:`sel`, and every PromQL expression is
evaluated against a real Prometheus by
tests/observability/metrics/test_prometheus.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

OUTPUT = pathlib.Path(__file__).resolve().parent / "dashboards" / "skan-broker.json"

# Panels query whichever Prometheus the "Data source" variable names.
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE_WINDOW = "$__rate_interval"
# Value of the "Bridge up" panel when no bridge is configured: not 0, which
# reads as "down" (red) although nothing is wrong.
NO_BRIDGE = -1


def sel(metric: str) -> str:
    """A metric narrowed to the chosen jobs and instances."""
    return f'{metric}{{job=~"$job", instance=~"$instance"}}'


def rate(metric: str) -> str:
    return f"rate({sel(metric)}[{RATE_WINDOW}])"


def increase(metric: str) -> str:
    return f"increase({sel(metric)}[{RATE_WINDOW}])"


def latency_quantile(q: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate('skan_routing_latency_seconds_bucket')}))"


def or_else(expr: str, value: int, **labels: str) -> str:
    """``expr``, or else (when it has no series at all) one series at ``value``
    carrying ``labels``, so the panel draws a line instead of saying "no data"."""
    fallback = f"vector({value})"
    for name, text in labels.items():
        fallback = f'label_replace({fallback}, "{name}", "{text}", "", "")'
    return f"{expr} or on() {fallback}"


def or_no_bridge(expr: str, value: int = 0) -> str:
    """Bridge panels on a broker without bridges: one series ``bridge="none"``."""
    return or_else(expr, value, bridge="none")


def nonzero_by_reason(expr: str) -> str:
    """Per-(protocol, reason) rates without the zero ones.

    Every known reason is exported from start-up (so rate() sees the first
    event), which makes dozens of series that are almost always 0: draw only
    those that are not, and one "all none" line at 0 while none is.
    """
    return or_else(f"({expr}) > 0", 0, protocol="all", reason="none")


def query(ref: str, expr: str, legend: str) -> prometheus.Dataquery:
    return (prometheus.Dataquery().ref_id(ref).expr(expr).legend_format(legend).range()
            .editor_mode(pm.QueryEditorMode.CODE).datasource(DATASOURCE))


def _targets(panel, targets: list[tuple[str, str]]):
    for ref, (expr, legend) in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(query(ref, expr, legend))
    return panel


def stat_panel(pid: int, title: str, targets: list[tuple[str, str]], *, unit: str = "short",
               description: str = "", width: int = 4, height: int = 4,
               mappings: list[dm.ValueMapping] | None = None) -> stat.Panel:
    panel = (stat.Panel().id(pid).title(title).description(description).datasource(DATASOURCE)
             .span(width).height(height).unit(unit)
             .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
                             .fields(""))
             .color_mode(cm.BigValueColorMode.VALUE).graph_mode(cm.BigValueGraphMode.AREA)
             .text_mode(cm.BigValueTextMode.AUTO))
    if mappings:
        panel = panel.mappings(mappings)
    return _targets(panel, targets)


def graph(pid: int, title: str, targets: list[tuple[str, str]], *, unit: str = "short",
          description: str = "", width: int = 8, stacked: bool = False) -> timeseries.Panel:
    panel = (timeseries.Panel().id(pid).title(title).description(description)
             .datasource(DATASOURCE).span(width).height(8).unit(unit)
             .draw_style(cm.GraphDrawStyle.LINE).line_width(1).fill_opacity(10)
             .show_points(cm.VisibilityMode.NEVER)
             .stacking(cb.StackingConfig()
                       .mode(cm.StackingMode.NORMAL if stacked else cm.StackingMode.NONE)
                       .group("A"))
             .legend(cb.VizLegendOptions().show_legend(True)
                     .display_mode(cm.LegendDisplayMode.TABLE)
                     .placement(cm.LegendPlacement.BOTTOM).calcs(["mean", "max", "lastNotNull"]))
             .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
                      .sort(cm.SortOrder.DESCENDING)))
    return _targets(panel, targets)


def row(pid: int, title: str) -> db.Row:
    return db.Row(title).id(pid)


def variables(dash: db.Dashboard) -> db.Dashboard:
    def by_label(name: str, label: str, query_text: str) -> db.QueryVariable:
        return (db.QueryVariable(name).label(label).datasource(DATASOURCE).query(query_text)
                .include_all(True).multi(True).all_value(".*")
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dm.VariableSort.ALPHABETICAL_ASC))

    return (dash
            .with_variable(db.DatasourceVariable("datasource").label("Data source")
                           .type("prometheus"))
            .with_variable(by_label("job", "Job", "label_values(skan_uptime_seconds, job)"))
            .with_variable(by_label("instance", "Instance",
                                    'label_values(skan_uptime_seconds{job=~"$job"}, instance)')))


def build() -> db.Dashboard:
    dash = (db.Dashboard("Skan broker").uid("skan-broker")
            .description("Throughput, latency, connections, errors, bridges and routing log "
                         "of Skan brokers (skan_* metrics).")
            .tags(["skan", "broker"]).timezone("browser").editable()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR).refresh("10s").time("now-1h", "now")
            .version(1))
    dash = variables(dash)
    panels = [
        row(1, "Overview"),
        stat_panel(2, "Messages received / s",
                   [(f"sum({rate('skan_messages_received_total')})", "received")],
                   description="Messages routed per second, all protocols."),
        stat_panel(3, "Deliveries / s",
                   [(f"sum({rate('skan_messages_delivered_total')})", "delivered")],
                   description="Messages queued to recipients per second, all protocols."),
        stat_panel(4, "p99 routing latency", [(latency_quantile("0.99"), "p99")], unit="s",
                   description="99th percentile of chunk received -> frames queued."),
        stat_panel(5, "Open connections", [(f"sum({sel('skan_connections_open')})", "open")]),
        stat_panel(6, "Undeliverable / s",
                   [(f"sum({rate('skan_messages_undeliverable_total')})", "undeliverable")],
                   description="Messages that had no recipient."),
        stat_panel(7, "Uptime", [(f"max({sel('skan_uptime_seconds')})", "uptime")], unit="s"),

        row(8, "Traffic by protocol"),
        graph(9, "Messages received / s by protocol",
              [(f"sum by (protocol) ({rate('skan_messages_received_total')})", "{{protocol}}")],
              description="Messages routed from senders on each protocol.", stacked=True),
        graph(10, "Deliveries / s by protocol",
              [(f"sum by (protocol) ({rate('skan_messages_delivered_total')})",
                "{{protocol}}")],
              description="Messages queued to recipients on each protocol.", stacked=True),
        graph(11, "Bytes / s by protocol",
              [(f"sum by (protocol) ({rate('skan_received_bytes_total')})", "in {{protocol}}"),
               (f"sum by (protocol) ({rate('skan_delivered_bytes_total')})",
                "out {{protocol}}")], unit="Bps"),
        graph(12, "Messages / s by group (allow-listed and top-N)",
              [(f"sum by (group) ({rate('skan_group_messages_total')})", "{{group}}")],
              description="Per-group series exist only for [metrics] groups and the "
                          "top_groups busiest.", width=12),
        graph(13, "Deliveries / s by group (allow-listed and top-N)",
              [(f"sum by (group) ({rate('skan_group_deliveries_total')})", "{{group}}")],
              width=12),

        row(14, "Routing latency"),
        graph(15, "Routing latency quantiles",
              [(latency_quantile(q), f"p{label}") for q, label in
               (("0.5", "50"), ("0.9", "90"), ("0.99", "99"), ("0.999", "99.9"))],
              unit="s", width=12,
              description="From a received chunk's arrival to each of its messages being "
                          "queued to every recipient."),
        graph(16, "Mean routing latency",
              [(f"sum({rate('skan_routing_latency_seconds_sum')}) / "
                f"sum({rate('skan_routing_latency_seconds_count')})", "mean")],
              unit="s", width=12),

        row(17, "Connections and subscriptions"),
        graph(18, "Open connections by protocol",
              [(f"sum by (protocol) ({sel('skan_connections_open')})", "{{protocol}}")],
              stacked=True),
        graph(19, "Connections accepted and closed / s",
              [(f"sum by (protocol) ({rate('skan_connections_accepted_total')})",
                "accepted {{protocol}}"),
               (nonzero_by_reason(
                   f"sum by (protocol, reason) ({rate('skan_connections_closed_total')})"),
                "closed {{protocol}} {{reason}}")]),
        graph(20, "Subscriptions and groups",
              [(f"sum({sel('skan_subscriptions')})", "subscriptions"),
               (f"sum({sel('skan_groups')})", "groups"),
               (f"sum({sel('skan_retention_messages')})", "retained messages")]),
        graph(40, "Connections refused / s",
              [(nonzero_by_reason(
                  f"sum by (protocol, reason) ({rate('skan_connections_refused_total')})"),
                "refused {{protocol}} {{reason}}"),
               (f"sum({rate('skan_accept_errors_total')})", "accept errors")],
              width=24,
              description="Refused at accept: max_connections reached (broker-wide or the "
                          "listener's); accept errors: out of descriptors or memory."),

        row(21, "Errors, drops and slow consumers"),
        graph(22, "Protocol errors / s",
              [(nonzero_by_reason(
                  f"sum by (protocol, reason) ({rate('skan_protocol_errors_total')})"),
                "{{protocol}} {{reason}}")],
              description="Malformed or refused input, by protocol and reason (protocol "
                          "\"metrics\": faults of HTTP clients of the metrics port)."),
        graph(23, "Undeliverable and dropped / s",
              [(f"sum({rate('skan_messages_undeliverable_total')})", "undeliverable"),
               (f"sum by (protocol, reason) ({rate('skan_messages_dropped_total')})",
                "dropped {{protocol}} {{reason}}")]),
        graph(24, "Slow-consumer disconnects",
              [(f"sum({increase('skan_slow_consumer_disconnects_total')})", "disconnects")],
              description="Connections closed because their outgoing queue stayed full "
                          "(policy disconnect)."),
        graph(25, "Outgoing queue depth",
              [(f"max by (protocol) ({sel('skan_outgoing_queue_max_bytes')})",
                "fullest {{protocol}}"),
               (f"sum by (protocol) ({sel('skan_outgoing_queue_bytes')})", "total {{protocol}}"),
               (f"max({sel('skan_outgoing_queue_limit_bytes')})", "per-connection limit")],
              unit="bytes", width=24),

        row(26, "Bridges"),
        stat_panel(27, "Bridge up",
                   [(or_no_bridge(f"max by (bridge) ({sel('skan_bridge_up')})", NO_BRIDGE),
                     "{{bridge}}")],
                   description="1 while the bridge is connected to its peer; \"no bridges\" "
                               "when none is configured.",
                   width=8, height=8,
                   mappings=[dm.ValueMap(options={
                       str(NO_BRIDGE): dm.ValueMappingResult(text="no bridges", color="text"),
                       "0": dm.ValueMappingResult(text="down", color="red"),
                       "1": dm.ValueMappingResult(text="up", color="green"),
                   })]),
        graph(28, "Bridge reconnects",
              [(or_no_bridge(f"sum by (bridge) ({increase('skan_bridge_reconnects_total')})"),
                "{{bridge}}")]),
        graph(29, "Bridge messages / s",
              [(or_no_bridge(f"sum by (bridge) ({rate(f'skan_bridge_{kind}_messages_total')})"),
                f"{kind} {{{{bridge}}}}") for kind in ("sent", "received", "overflow")]),
        graph(30, "Bridge buffers",
              [(or_no_bridge(f"sum by (bridge) ({sel('skan_bridge_buffered_messages')})"),
                "{{bridge}}")], width=24),

        row(31, "Routing log"),
        graph(32, "Routing-log lag", [(f"max({sel('skan_routelog_lag_seconds')})", "lag")],
              unit="s", description="Age of the oldest record not yet written."),
        graph(33, "Routing-log records / s and files",
              [(f"sum({rate('skan_routelog_records_total')})", "records / s"),
               (f"sum({increase('skan_routelog_files_total')})", "files completed")]),
        graph(34, "Routing-log queue and back-pressure",
              [(f"sum({sel('skan_routelog_queued_records')})", "queued records"),
               (f"sum({increase('skan_routelog_backpressure_waits_total')})",
                "back-pressure waits")]),
        graph(35, "Routing-log disk errors and losses",
              [(f"sum({increase('skan_routelog_errors_total')})", "disk errors (retried)"),
               (f"sum({increase('skan_routelog_lost_records_total')})", "records lost"),
               (f"max({sel('skan_routelog_writer_failed')})", "writer failed")],
              width=24,
              description="Should stay at 0: retried disk errors, records given up at stop, "
                          "a dead writer."),

        row(36, "Process"),
        graph(37, "CPU", [(rate("process_cpu_seconds_total"), "{{instance}}")],
              unit="percentunit"),
        graph(38, "Memory", [(sel("process_resident_memory_bytes"), "{{instance}}")],
              unit="bytes"),
        graph(39, "Open file descriptors",
              [(sel("process_open_fds"), "{{instance}}"),
               (sel("process_max_fds"), "limit {{instance}}")]),

        row(43, "Security"),
        graph(44, "Authentication failures / s",
              [(f"sum by (protocol) ({rate('skan_auth_failures_total')})", "{{protocol}}")],
              width=12,
              description="Connections refused for their credentials (wrong token, anonymous "
                          "where not allowed, a user over max_connections, a required client "
                          "certificate missing), by protocol."),
        graph(45, "Permission refusals / s",
              [(f"sum by (protocol, action) ({rate('skan_permission_denied_total')})",
                "{{protocol}} {{action}}")],
              width=12,
              description="Sends (publish) and subscriptions (subscribe) refused by the "
                          "user's permissions, by protocol and action."),

        row(46, "Cluster"),
        stat_panel(47, "Brokers seen",
                   [(f"max({sel('skan_cluster_brokers_seen')})", "brokers")],
                   description="Brokers of the cluster heard from within three heartbeats "
                               "(this one included); 0: no cluster.", width=6, height=8),
        stat_panel(48, "NATS connected",
                   [(f"min({sel('skan_cluster_up')})", "up")],
                   description="1 while every chosen broker is connected to NATS; 0 also "
                               "on a broker without a cluster.", width=6, height=8),
        graph(49, "Backplane messages / s",
              [(f"sum by (direction) ({rate('skan_backplane_messages_total')})",
                "{{direction}}")], width=6,
              description="Routed messages published to (out) and received from (in) NATS."),
        graph(50, "Backplane drops, duplicates, withheld / s",
              [(f"sum({rate('skan_backplane_drops_total')})", "dropped (not published)"),
               (f"sum({rate('skan_backplane_duplicates_total')})", "duplicates dropped"),
               (f"sum({rate('skan_backplane_withheld_total')})", "withheld (no remote interest)"),
               (f"sum({rate('skan_backplane_malformed_total')})", "malformed from NATS")],
              width=6,
              description="Drops: messages not published while NATS was down or its queue "
                          "full. Duplicates: second copies from overlapping subscriptions. "
                          "Withheld: not published, no other broker wants them (normal). "
                          "Malformed: undecodable messages from NATS (should stay 0)."),

        row(51, "Durable store"),
        graph(52, "Store writes / s",
              [(f"sum({rate('skan_store_written_messages_total')})", "messages committed"),
               (f"sum({rate('skan_store_commits_total')})", "commits")], width=8,
              description="Retained messages committed to the store (one transaction per "
                          "flush_interval at most)."),
        graph(53, "Store size and queue",
              [(f"sum({sel('skan_store_bytes')})", "retained frame bytes"),
               (f"sum({sel('skan_store_pending')})", "queued operations")], width=8),
        graph(54, "Store failures / s",
              [(f"sum({rate('skan_store_failed_commits_total')})", "failed commits"),
               (f"sum({rate('skan_store_unpersisted_messages_total')})", "not persisted"),
               (f"sum({rate('skan_store_spool_dropped_messages_total')})",
                "spool pushed out"),
               (f"sum({rate('skan_store_spool_lost_operations_total')})", "spool ops lost")],
              width=8,
              description="Should stay at 0: commits that failed (disk full, I/O error), "
                          "messages routed but never persisted, bridge spool messages pushed "
                          "out by spool_max_bytes, spool operations given up after failures."),
    ]
    for panel in panels:
        dash = dash.with_row(panel) if isinstance(panel, db.Row) else dash.with_panel(panel)
    return dash


def render() -> str:
    """The dashboard as committed: JSON, two-space indent, trailing newline."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare: exit 1 if the committed file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT.name} is out of date: run python grafana/generate.py",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
