"""The import rule of docs/architecture.md, checked on the source (``ast``, nothing imported).

Every module of the project belongs to one layer; a layer may import only the
layers listed for it (its own included), and no set of modules imports itself
round in a circle -- type-only imports (``if TYPE_CHECKING:``) and imports
inside functions count too, because a reader follows them all the same.
"""

from __future__ import annotations

import ast
import pathlib

import attrs

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("wire", "toolkit", "broker", "clients", "analytics")

# Module prefix -> layer; the longest matching prefix decides.  Lowest first.
LAYER_OF: dict[str, str] = {
    "wire": "wire",
    "toolkit": "toolkit",
    "broker": "core",  # broker/__init__.py: empty
    "broker.core": "core",
    # What holds the broker's state below the trio layer: the durable store,
    # its retained-message queries, the cluster's formats and link, the
    # routing log's records and files.
    "broker.store": "state",
    "broker.cluster": "state",
    "broker.observability": "state",
    "broker.observability.routelog": "state",
    "broker.observability.latency": "state",
    # The ground: trio transport, TLS, admission, config, context, scheduling,
    # file descriptors, the bridge runner.
    "broker.serving": "serving",
    # The services the application starts, each on the ground.
    "broker.protocols": "services",
    "broker.cluster.cluster_service": "services",
    "broker.store.store_service": "services",
    "broker.observability.http": "services",
    "broker.observability.metrics": "services",
    "broker.observability.routelog.routelog_service": "services",
    # The application: start/stop, the service list, bridges, CLI, reload, workers.
    "broker.app": "app",
    "broker.__main__": "app",
    "clients": "clients",
    "analytics": "analytics",
}

MAY_IMPORT: dict[str, set[str]] = {
    "wire": {"wire"},
    "toolkit": {"wire", "toolkit"},
    "core": {"wire", "core"},
    "state": {"wire", "core", "state"},
    "serving": {"wire", "toolkit", "core", "state", "serving"},
    "services": {"wire", "toolkit", "core", "state", "serving", "services"},
    "app": {"wire", "toolkit", "core", "state", "serving", "services", "app"},
    "clients": {"wire", "toolkit", "clients"},
    "analytics": {"toolkit", "analytics"},
}


def layer_of(module: str) -> str:
    best = ""
    for prefix in LAYER_OF:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    assert best, f"{module}: no layer (add it to LAYER_OF and docs/architecture.md)"
    return LAYER_OF[best]


@attrs.frozen
class Import:
    source: str
    target: str
    line: int


def project_modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _extensions() -> set[str]:
    """Compiled modules (their C source stands for them): leaves of the graph."""
    return {".".join(c.relative_to(ROOT).with_suffix("").parts)
            for package in PACKAGES for c in (ROOT / package).rglob("*.c")}


def imports(modules: dict[str, pathlib.Path]) -> list[Import]:
    known = set(modules) | _extensions()
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import mod`` names the module; ``from mod import name`` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            for target in targets:
                if target.split(".")[0] in PACKAGES:
                    while target not in known and "." in target:
                        target = target.rsplit(".", 1)[0]
                    found.append(Import(name, target, node.lineno))
    return found


MODULES = project_modules()
IMPORTS = imports(MODULES)


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_run_down_the_layers():
    wrong = [f"{i.source}:{i.line} imports {i.target} ({layer_of(i.source)} may not import "
             f"{layer_of(i.target)})"
             for i in IMPORTS if layer_of(i.target) not in MAY_IMPORT[layer_of(i.source)]]
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target in graph and i.target != i.source:
            graph[i.source].add(i.target)
    # Tarjan's strongly connected components: any component of two or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_checker_sees_what_it_must():
    """The rules above would pass on an empty graph: make sure they look at real edges."""
    edges = {(i.source, i.target) for i in IMPORTS}
    assert ("broker.app.services", "broker.protocols.skan.listener") in edges
    assert ("broker.serving.transport", "toolkit.streams") in edges
    assert ("wire.skan", "wire.skan.codec") in edges
    assert ("wire.skan.codec", "wire.skan._codec_speedups") in edges
    # A type-only import counts.
    assert ("broker.serving.context", "broker.store") in edges
    assert layer_of("broker.cluster.cluster_service") == "services"
    assert layer_of("broker.cluster.backplane") == "state"


def test_broker_imports_no_client_and_analytics_nothing_of_the_broker():
    for i in IMPORTS:
        if i.source.startswith("broker"):
            assert not i.target.startswith("clients"), i
        if i.source.startswith("analytics"):
            assert not i.target.startswith(("broker", "clients")), i
        if i.source.startswith("wire"):
            assert i.target.startswith("wire"), i


def test_analytics_default_log_dir_is_the_brokers():
    from analytics.cli import DEFAULT_LOG_DIR
    from broker.serving.config import LogSection

    assert attrs.fields_dict(LogSection)["dir"].default == DEFAULT_LOG_DIR
