"""The source tree by family (issues 29 and 49): few top-level modules in ``libs/marlaas``, the
platform below the stack, the CLI and the SDK, the gateway laid out as a web service, and no
circle of imports anywhere in ``libs/`` or ``services/``, read from the source (the graph imports
nothing); and one home for each subject, limit and name (issues 36 and 49)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from marlaas.platform import limits, subjects, tenants
from marlaas.stack import broker_auth
from marlaas.tools import registry, serving

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / "libs"
PKG = LIBS / "marlaas"
SERVICES = ROOT / "services"
MAX_TOP_LEVEL = 6
ABOVE_PLATFORM = ("marlaas.stack", "marlaas.cli", "marlaas.sdk")


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBS if path.is_relative_to(LIBS) else ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for top in (PKG, SERVICES) for p in top.rglob("*.py")}


def imported_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of what ``from ... import`` names (``from .x import y`` resolved)."""
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(path: Path) -> set[str]:
    """The modules of ``libs/marlaas`` and ``services`` that ``path`` imports, lazily (inside a
    function) or not; ``TYPE_CHECKING`` ones left out."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = imported_module(path, node)
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.add(sub if sub in MODULES else module)
    return {m for m in found if m in MODULES}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, f"libs/marlaas/ has {len(top)} modules at its top level: {top}"


def test_platform_imports_no_stack_cli_or_sdk():
    wrong = {name: sorted(m for m in deps if m.startswith(ABOVE_PLATFORM))
             for name, deps in GRAPH.items() if name.startswith("marlaas.platform")}
    assert not {k: v for k, v in wrong.items() if v}, wrong


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The sets of modules that import each other, each through the others (Tarjan's strongly
    connected components of more than one module, or of one that imports itself)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return components


def way_round(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest circle from the first (by name) of ``component`` back to itself (breadth first)."""
    start = min(component)
    came_from: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for dep in sorted(graph[node] & component):
                if dep == start:
                    way = [node]
                    while came_from[way[-1]] is not None:
                        way.append(came_from[way[-1]])
                    return [*reversed(way), start]
                if dep not in came_from:
                    came_from[dep] = node
                    following.append(dep)
        frontier = following
    raise AssertionError(f"no way round {sorted(component)}")


def test_no_circle_of_imports():
    """No module of ``libs/marlaas`` or ``services`` imports, through others, itself: lazy imports
    inside functions count (they only hide a circle), ``TYPE_CHECKING`` ones do not."""
    found = [f"{' -> '.join(way_round(GRAPH, tangle))} ({len(tangle)} modules tangled: {sorted(tangle)})"
             for tangle in tangles(GRAPH)]
    assert not found, "modules that import each other in a circle:\n" + "\n".join(found)


def test_a_circle_is_named_module_by_module():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert [way_round(graph, tangle) for tangle in tangles(graph)] == [["a", "b", "c", "a"], ["e", "e"]]
    assert tangles({"a": {"b"}, "b": set()}) == []


def test_the_gateway_is_laid_out_as_a_web_service():
    """Issue 49: ``context.py`` (the request context and errors) is a leaf, ``auth.py`` and
    ``operations.py`` hold authentication and the operations routes, ``app.py`` only assembles the
    routers; no route module imports ``app`` (``service.py`` runs it), and the gateway's modules
    import each other at the top (the entry point's late import of the service aside, STYLE 5)."""
    gateway = {name: deps for name, deps in GRAPH.items() if name.startswith("services.gateway")}
    for module in ("context", "auth", "operations", "app"):
        assert f"services.gateway.{module}" in gateway, module
    assert {name for name, deps in gateway.items() if "services.gateway.app" in deps} == {"services.gateway.service"}
    reached, todo = set(), ["services.gateway.context"]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep.startswith("services.") and dep not in reached:
                reached.add(dep)
                todo.append(dep)
    assert reached <= {"services.gateway.reads", "services.gateway.metrics"}, f"context.py reaches {reached}"
    late = [f"{name}.{node.name}" for name in gateway if name != "services.gateway.__main__"
            for node in ast.walk(ast.parse(MODULES[name].read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for inner in ast.walk(node)
            if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("services.")]
    assert not late, f"gateway modules imported inside a function (import them at the top): {late}"


# --- the wrong-way ties cut in issue 36 ---------------------------------------------------------


def test_the_runtime_names_no_service_module():
    """Each entry point hands its ``run`` to ``run_service``: the platform never imports a service
    (by name or by an importlib string)."""
    source = (PKG / "platform" / "runtime.py").read_text()
    tree = ast.parse(source)
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not {c for c in calls if "import_module" in c or c == "__import__"}, calls
    assert "services." not in source.replace("python -m services.", "")


def test_the_platforms_data_files_name_no_task():
    """``platform/files.py`` reads tenants' data; the task lookup is handed in by the services
    (``DataFiles(..., get_task)``): the platform imports nothing from ``marlaas.tasks``."""
    assert not {m for m in GRAPH["marlaas.platform.files"] if m.startswith("marlaas.tasks")}
    assert not {m for name, deps in GRAPH.items() if name.startswith("marlaas.platform")
                for m in deps if m.startswith("marlaas.tasks")}


SOURCES = [p for top in (LIBS, SERVICES) for p in top.rglob("*.py")]


def strays(pattern: re.Pattern, home: set[Path]) -> list[str]:
    """``path:line`` of every line of ``libs`` and ``services`` outside ``home`` that ``pattern`` finds."""
    return [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES if p not in home
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]


def test_subjects_and_limits_have_one_home_each():
    """Every NATS subject is built by ``marlaas.platform.subjects``: the services', a KV bucket's
    (``$KV.<bucket>.<key>`` of stream ``KV_<bucket>``) and the broker's permission patterns
    (``stack/broker_auth.py`` builds them with the same builders, issue 49); no subject is built by
    adding tokens to one of its constants elsewhere. The job limits, the nesting of request bodies
    and the NATS message sizes live in ``marlaas.platform.limits``: no ``max_payload`` is written as
    a number anywhere else, and the static broker configs under ``deploy/`` say what it says."""
    home = {PKG / "platform" / "subjects.py"}
    kinds = "job|policy|trajectory|span|usage|tinker|api|registry|tool|reward|tenant"
    written = re.compile(rf"""["']marlaas\.({kinds})\.""")
    assert not strays(written, home), f"subjects written out of marlaas.platform.subjects: {strays(written, home)}"
    kv = re.compile(r"""["']\$KV\.|["']KV_""")
    assert not strays(kv, home), f"KV subjects or streams written out of marlaas.platform.subjects: {strays(kv, home)}"
    extended = re.compile(r"\{subjects\.[A-Z_]+\}\.\{")  # f"{subjects.REWARD}.{task}": a builder's work
    assert not strays(extended, home), f"subjects extended out of marlaas.platform.subjects: {strays(extended, home)}"

    defined = re.compile(r"^(MAX_STEPS|MAX_VERSION|MAX_SEED|MAX_JOB_SEED|MAX_SAMPLING_SEED|MAX_ERROR_CHARS"
                         r"|MAX_JSON_NESTING|MAX_NESTING|MAX_MESSAGE_BYTES|MAX_TENANT_MESSAGE_BYTES"
                         r"|MAX_TINKER_REQUEST_BYTES)\s*=", re.M)
    homes = [str(p.relative_to(ROOT)) for p in SOURCES if defined.search(p.read_text())]
    assert homes == ["libs/marlaas/platform/limits.py"], homes
    payload = re.compile(r"""max_payload["']?\s*[:=]\s*\d""")
    assert not strays(payload, set()), f"max_payload set out of marlaas.platform.limits: {strays(payload, set())}"
    configs = {p: re.findall(r"^max_payload:\s*(\d+)MB\b", p.read_text(), re.M)
               for p in (ROOT / "deploy").rglob("*.conf") if "max_payload" in p.read_text()}
    assert configs, "no broker config under deploy/ sets max_payload"
    for path, found in configs.items():  # nats-server reads MB as MiB
        assert [int(mb) << 20 for mb in found] == [limits.MAX_MESSAGE_BYTES], (path, found)


def test_the_tenant_name_has_one_home():
    """The tenant-name pattern is written once, as ``subjects.TENANT_NAME`` (issue 49); the job id
    and the tenants' name and token checks are built from it."""
    home = PKG / "platform" / "subjects.py"
    written = re.compile(re.escape(subjects.TENANT_NAME))
    assert not strays(written, {home}), f"the tenant-name pattern written again: {strays(written, {home})}"
    assert home.read_text().count(subjects.TENANT_NAME) == 1
    assert subjects.TENANT_NAME in subjects.JOB_ID.pattern
    assert subjects.TENANT_NAME in tenants.TENANT_RE.pattern and subjects.TENANT_NAME in tenants.TOKEN_RE.pattern


def test_what_must_fit_one_nats_message_does():
    """The sizes that assume a NATS message's bound are held to ``limits`` (issue 49): a tool's
    answer (JSON writes a character in at most 6 bytes) and an announcement fit a tenant's
    message; a Tinker request, as base64 (4/3 of it) in its JSON, fits the broker's."""
    assert 6 * serving.MAX_OUTPUT_CHARS < limits.MAX_TENANT_MESSAGE_BYTES
    assert registry.MAX_SPEC_BYTES < limits.MAX_TENANT_MESSAGE_BYTES
    assert broker_auth.TENANT_LIMITS["max_payload"] == limits.MAX_TENANT_MESSAGE_BYTES <= limits.MAX_MESSAGE_BYTES
    assert 4 * -(-limits.MAX_TINKER_REQUEST_BYTES // 3) < limits.MAX_MESSAGE_BYTES


def test_the_tinker_files_and_the_sdks_are_named_by_role():
    """Issue 36: four files were named ``tinker.py`` and two things "sdk"; each now says what it
    does (gateway ``tinker_api.py``, trainer ``tinker_training.py``, rollout ``tinker_sampling.py``,
    ``platform/tinker_records.py``; ``marlaas.sdk`` is the HTTP client, ``tools/serving.py`` serves tools)."""
    root = LIBS.parent
    names = [p.relative_to(root) for top in ("libs", "services") for p in (root / top).rglob("*.py")]
    assert not [p for p in names if p.name in ("tinker.py", "sdk.py")], names
    for path in ("services/gateway/tinker_api.py", "services/trainer/tinker_training.py",
                 "services/rollout/tinker_sampling.py", "libs/marlaas/platform/tinker_records.py",
                 "libs/marlaas/tools/serving.py", "libs/marlaas/sdk/http.py"):
        assert (root / path).is_file(), path


# --- issue 49: wiring stays wiring, and tests use what modules offer ------------------------------

MAX_MANAGER_WIRING_LINES = 300


def private_imports(path: Path) -> list[str]:
    """``from X import _name`` in ``path``, X a module of ``libs/`` or ``services/``."""
    return [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and not node.level and node.module
            and node.module.split(".")[0] in ("marlaas", "services")
            for alias in node.names if alias.name.startswith("_")]


def test_no_test_imports_a_private_name():
    """A name a test needs is public where it lives (a test-only re-export or pass-through is not)."""
    root = LIBS.parent
    found = {str(p.relative_to(root)): names for p in sorted((root / "tests").rglob("*.py"))
             if (names := private_imports(p))}
    assert not found, f"tests import private names: {found}"


def test_the_managers_service_module_is_wiring():
    """``services/manager/service.py`` wires the manager's parts to the bus; what they do lives in
    modules of their own."""
    lines = len((LIBS.parent / "services" / "manager" / "service.py").read_text().splitlines())
    assert lines <= MAX_MANAGER_WIRING_LINES, f"services/manager/service.py has {lines} lines"


MAX_MODULE_LINES = 500  # STYLE 10
SIZE_REASON = re.compile(r"# over 500 lines: \S.*")


def test_a_module_over_500_lines_says_why_at_its_top():
    """Issue 49: a module of ``libs/`` or ``services/`` over 500 lines opens, above its docstring,
    with one line saying why it is not split: ``# over 500 lines: <the reason>``."""
    unexplained = []
    for path in sorted(SOURCES):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES and not SIZE_REASON.fullmatch(lines[0]):
            unexplained.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not unexplained, f"modules over {MAX_MODULE_LINES} lines without a reason on their first line: {unexplained}"
