"""``libs/marlaas`` by family (issue 29): few top-level modules, the platform below the stack, the
CLI and the SDK, and no circle of imports, read from the source (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

LIBS = Path(__file__).resolve().parents[2] / "libs"
PKG = LIBS / "marlaas"
MAX_TOP_LEVEL = 6
ABOVE_PLATFORM = ("marlaas.stack", "marlaas.cli", "marlaas.sdk")


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """The ``marlaas`` modules ``path`` imports, lazily or not (``TYPE_CHECKING`` ones left out)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("marlaas")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("marlaas") and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m in MODULES}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, f"libs/marlaas/ has {len(top)} modules at its top level: {top}"


def test_platform_imports_no_stack_cli_or_sdk():
    wrong = {name: sorted(m for m in deps if m.startswith(ABOVE_PLATFORM))
             for name, deps in GRAPH.items() if name.startswith("marlaas.platform")}
    assert not {k: v for k, v in wrong.items() if v}, wrong


def test_no_circle_of_imports():
    """Tarjan's strongly connected components over module-to-module imports (lazy ones too)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in GRAPH[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert not circles, f"modules that import each other in a circle: {circles}"


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


def test_subjects_and_limits_have_one_home_each():
    """Every NATS subject is built by ``marlaas.platform.subjects`` (the broker's permission
    patterns, ``stack/broker_auth.py``, aside); the job limits live in ``marlaas.platform.limits``."""
    import re

    subject = re.compile(r"""["']marlaas\.(job|policy|trajectory|span|tinker|api|registry|tool|reward)\.""")
    sources = [p for top in ("libs", "services") for p in (LIBS.parent / top).rglob("*.py")]
    home = {PKG / "platform" / "subjects.py", PKG / "stack" / "broker_auth.py"}
    strays = [f"{p.relative_to(LIBS.parent)}:{n}" for p in sources if p not in home
              for n, line in enumerate(p.read_text().splitlines(), 1) if subject.search(line)]
    assert not strays, f"subjects written out of marlaas.platform.subjects: {strays}"
    defined = re.compile(r"^(MAX_STEPS|MAX_VERSION|MAX_SEED|MAX_JOB_SEED|MAX_SAMPLING_SEED|MAX_ERROR_CHARS)\s*=", re.M)
    homes = [str(p.relative_to(LIBS.parent)) for p in sources if defined.search(p.read_text())]
    assert homes == ["libs/marlaas/platform/limits.py"], homes


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
