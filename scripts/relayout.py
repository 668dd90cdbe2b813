"""Re-lay ``libs/marlaas`` by family (issue 29): the users' surface on top, ``platform/`` and ``stack/`` below.

Run from the repository root: ``python scripts/relayout.py`` (``--dry-run`` lists the moves only).
It is meant to be run again after others' edits land on main, and running it twice changes
nothing the second time:

1. ``git mv`` each flat module to its sub-package (:data:`MOVES`), skipping moves already done,
   and writes the new packages' ``__init__.py`` if missing;
2. rewrites every reference to an old path in the repository's text files: ``from marlaas.x
   import``, ``from marlaas import x`` (and ``x.attr`` where the module's name changes),
   ``import marlaas.x``, dotted paths in strings (``python -m marlaas.demo``, monkeypatch and
   mock targets, entry points) and file paths (``libs/marlaas/x.py``);
3. cuts the ties that ran the wrong way by moving named top-level definitions from one module
   to another (:data:`SPLITS`), with the imports they need, and redirects every import and
   dotted path of those names.

Nothing re-exports an old path. ``tests/unit/test_layout.py`` checks the result's import graph.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "libs" / "marlaas"
SELF = Path(__file__).resolve()

# old module (under marlaas) -> new module
MOVES = {
    "adapters": "platform.adapters",
    "api": "platform.api",
    "audit": "platform.audit",
    "bus": "platform.bus",
    "client": "platform.nats_client",
    "commits": "platform.commits",
    "config": "platform.config",
    "events": "platform.events",
    "files": "platform.files",
    "logs": "platform.logs",
    "processes": "platform.processes",
    "runtime": "platform.runtime",
    "store": "platform.store",
    "telemetry": "platform.telemetry",
    "tenants": "platform.tenants",
    "sdk.schema": "platform.http_api",
    "admin": "stack.admin",
    "embedded_nats": "stack.embedded_nats",
    "launcher": "stack.launcher",
    "natsauth": "stack.broker_auth",
    "cli": "cli.commands",
    "demo": "cli.demo",
    "report": "cli.report",
}

PACKAGE_DOCS = {
    "platform": '"""The platform: wire contracts (``events``, ``api``, ``http_api``), the bus and the object store,\n'
                'config, the services\' runtime, tenants\' records, and what clients need to reach the broker.\n\n'
                'Nothing here imports the embedded stack (:mod:`marlaas.stack`), the CLI or the SDK."""\n',
    "stack": '"""The embedded stack that ``marlaas up`` runs: the launcher, the embedded nats-server and the\n'
             'broker\'s ``auth.conf`` rendered from the tenants, and the operator\'s ``marlaas tenant`` commands."""\n',
    "cli": '"""The ``marlaas`` command line: its commands, the demo and the job report."""\n',
}

# Files the new packages need besides their __init__.py (written if missing).
EXTRA_FILES = {
    "cli/__main__.py": '"""``python -m marlaas.cli``: the ``marlaas`` command."""\n\nimport sys\n\n'
                       'from marlaas.cli.commands import main\n\nsys.exit(main())\n',
}

# (from module, to module, top-level names moved, why)
SPLITS = [
    ("stack.broker_auth", "platform.nats_access",
     ["SERVICES_USER", "PLATFORM_ACCOUNT", "BCRYPT_ROUNDS", "registry_subject", "bcrypt_hash", "inbox_prefix",
      "server_urls", "_one_with_credentials", "url_with_credentials", "url_credentials", "redact_url"],
     "the broker's names and credentials in URLs belong with the bus; the rendering with the stack"),
    ("platform.tenants", "stack.broker_auth", ["write_broker_auth"],
     "rendering the broker's users and reloading it is the stack's job; tenants keeps the records"),
    ("stack.launcher", "sdk.discovery", ["DEFAULT_TOKEN_FILE", "default_tenant_token", "running_nats_url"],
     "clients find the running stack through what it leaves under <home>/run, not through the launcher"),
    ("stack.embedded_nats", "stack.broker_auth", ["find_server_binary"],
     "checking auth.conf needs the binary too; embedded_nats imports broker_auth, never the reverse"),
    ("sdk.http", "platform.http_api", ["PATH_FIELDS", "is_file_id"],
     "a job's data fields and file ids are the HTTP contract, which the gateway's files use too"),
]

NEW_DOCS = {
    "platform.nats_access": '"""How a client reaches the broker: the platform\'s user and account names, a tenant\'s\n'
                            'registry subject and inbox prefix, token hashes, and credentials in broker URLs."""\n\n'
                            'from __future__ import annotations\n',
}

# Dotted names that are NATS subjects, not module paths: never rewritten.
SUBJECTS = re.compile(r"marlaas\.api\.(submit|status|cancel|delete|pin|ping)\b")

TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".txt", ".sh", ".json", ".rst", ".j2"}
TEXT_NAMES = {"Makefile", "Dockerfile", ".dockerignore", ".gitignore"}


def sh(*args: str) -> str:
    return subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def module_file(module: str) -> Path:
    return PKG.joinpath(*module.split(".")).with_suffix(".py")


def text_files() -> list[Path]:
    files = []
    for name in sh("git", "ls-files", "-co", "--exclude-standard").splitlines():
        path = ROOT / name
        if path.resolve() == SELF or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES or name.startswith(".ci/"):
            files.append(path)
    return files


# --- 1. moves -----------------------------------------------------------------------------


def move_modules(dry_run: bool) -> None:
    for package, doc in PACKAGE_DOCS.items():
        init = PKG / package / "__init__.py"
        if not init.exists() and not dry_run:
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(doc)
            sh("git", "add", str(init))
    for name, text in EXTRA_FILES.items():
        path = PKG / name
        if not path.exists() and not dry_run:
            path.write_text(text)
            sh("git", "add", str(path))
    for old, new in MOVES.items():
        src, dst = module_file(old), module_file(new)
        if not src.exists():
            continue
        if dst.exists():
            sys.exit(f"both {src} and {dst} exist: merge them by hand, then run again")
        print(f"git mv {src.relative_to(ROOT)} {dst.relative_to(ROOT)}")
        if not dry_run:
            dst.parent.mkdir(parents=True, exist_ok=True)
            sh("git", "mv", str(src), str(dst))


# --- 2. references to old paths -------------------------------------------------------------

NEW_PATHS = {f"marlaas.{n}" for n in MOVES.values()} | {f"marlaas.{p}" for p in PACKAGE_DOCS}


def new_dotted(dotted: str, moves: dict[str, str]) -> str:
    """``dotted`` (``marlaas.a.b.c``) with its longest old-module prefix replaced."""
    if SUBJECTS.match(dotted):
        return dotted
    if any(dotted == p or dotted.startswith(p + ".") for p in NEW_PATHS if p not in {f"marlaas.{o}" for o in moves}):
        return dotted  # already a new path (cli -> cli.commands must not match its own result)
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        old = ".".join(parts[1:n])
        if old in moves:
            return ".".join(["marlaas", moves[old], *parts[n:]])
    return dotted


def rewrite_dotted(text: str, moves: dict[str, str]) -> str:
    """Old module paths in ``text`` replaced. A module that became a package of the same name
    (``marlaas.cli``) is rewritten bare only where a module is meant: ``from marlaas.cli import``,
    ``marlaas.cli:main``, ``-m marlaas.cli``; elsewhere ``marlaas.cli`` names the package."""
    def one(m: re.Match) -> str:
        old = m[0].removeprefix("marlaas.")
        if old in moves and moves[old].startswith(old + "."):
            after, before = text[m.end():m.end() + 8], text[max(0, m.start() - 3):m.start()]
            if not (after.startswith(":") or re.match(r"\s+import\b", after) or before == "-m "):
                return m[0]
        return new_dotted(m[0], moves)
    return re.sub(r"\bmarlaas(?:\.\w+)+", one, text)


def rewrite_paths(text: str, moves: dict[str, str]) -> str:
    def path(m: re.Match) -> str:
        old = m[2].replace("/", ".")
        return f"{m[1]}marlaas/{moves[old].replace('.', '/')}.py" if old in moves else m[0]
    return re.sub(r"(\blibs/|(?<![\w/])|\.\./)marlaas/([\w/]+)\.py\b", path, text)


def _statement(indent: str, module: str, names: list[str]) -> str:
    line = f"{indent}from {module} import {', '.join(names)}"
    if len(line) <= 110:
        return line
    body = "".join(f"{indent}    {n},\n" for n in names)
    return f"{indent}from {module} import (\n{body}{indent})"


def _alias_text(alias: ast.alias) -> str:
    return alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"


def _replace_lines(text: str, edits: list[tuple[int, int, str]]) -> str:
    lines = text.split("\n")
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = new.split("\n") if new else []
    return "\n".join(lines)


def rewrite_module_imports(text: str, moves: dict[str, str]) -> str:
    """``from marlaas[.pkg] import old_module`` -> ``from marlaas.new_pkg import new_module``; where
    the module's own name changes (and no ``as``), its uses ``old.attr`` follow."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    edits, renames = [], {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("marlaas") or node.level:
            continue
        base = node.module.removeprefix("marlaas").lstrip(".")
        moved = {a.name: moves[f"{base}.{a.name}".lstrip(".")] for a in node.names
                 if f"{base}.{a.name}".lstrip(".") in moves}
        if not moved:
            continue
        indent = " " * node.col_offset
        groups: dict[str, list[str]] = {}
        for a in node.names:
            if a.name in moved:
                parent, _, name = moved[a.name].rpartition(".")
                groups.setdefault(f"marlaas.{parent}", []).append(
                    name if a.asname is None else f"{name} as {a.asname}")
                if a.asname is None and name != a.name:
                    renames[a.name] = name
            else:
                groups.setdefault(node.module, []).append(_alias_text(a))
        edits.append((node.lineno, node.end_lineno, "\n".join(_statement(indent, m, n) for m, n in groups.items())))
    text = _replace_lines(text, edits)
    for old, new in renames.items():
        text = re.sub(rf"(?<![\w.]){old}\.(?=[A-Za-z_])", f"{new}.", text)
    return text


# --- 3. splits: named top-level definitions move between modules ------------------------------


def _names_used(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _top_level_defs(tree: ast.Module) -> dict[str, ast.stmt]:
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    return defs


def _segment(lines: list[str], node: ast.stmt, previous_end: int) -> tuple[int, int]:
    """1-based line span of ``node`` with its decorators and the comments above it (up to the
    statement before; a comment block separated by blank lines from it goes along too)."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    first = start
    while first - 1 > previous_end and (lines[first - 2].strip().startswith("#") or not lines[first - 2].strip()):
        first -= 1
    while first < start and not lines[first - 1].strip():
        first += 1
    return first, node.end_lineno


def _imports(tree: ast.Module) -> dict[str, str]:
    """Top-level imported name -> the statement importing just it."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a in node.names:
                found[a.asname or a.name] = f"from {'.' * node.level}{node.module or ''} import {_alias_text(a)}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                found[a.asname or a.name.split(".")[0]] = f"import {_alias_text(a)}"
    return found


def _insert_imports(text: str, statements: list[str]) -> str:
    """Add ``statements`` after the module's last top-level import (merging ``from`` names)."""
    if not statements:
        return text
    tree = ast.parse(text)
    existing = {ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    statements = [s for s in dict.fromkeys(statements) if s not in existing]
    if not statements:
        return text
    merged: dict[str, list[str]] = {}
    plain = []
    for s in statements:
        m = re.fullmatch(r"from (\S+) import (.+)", s)
        if m:
            merged.setdefault(m[1], []).append(m[2])
        else:
            plain.append(s)
    block = plain + [_statement("", mod, names) for mod, names in merged.items()]
    ends = [n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if ends:
        at = max(ends)
    else:  # after the docstring
        at = tree.body[0].end_lineno if tree.body and isinstance(tree.body[0], ast.Expr) else 0
    lines = text.split("\n")
    lines[at:at] = block
    return "\n".join(lines)


def _drop_unused_imports(text: str) -> str:
    tree = ast.parse(text)
    used = _names_used(tree) | {n.value.id for n in ast.walk(tree)
                                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    edits = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            keep = [a for a in node.names if (a.asname or a.name) in used | exported]
        elif isinstance(node, ast.Import):
            keep = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used | exported]
        else:
            continue
        if len(keep) == len(node.names):
            continue
        if not keep:
            new = ""
        elif isinstance(node, ast.Import):
            new = f"import {', '.join(_alias_text(a) for a in keep)}"
        else:
            new = _statement("", f"{'.' * node.level}{node.module or ''}", [_alias_text(a) for a in keep])
        edits.append((node.lineno, node.end_lineno, new))
    return _replace_lines(text, edits)


def move_definitions(src_mod: str, dst_mod: str, names: list[str]) -> bool:
    """Cut ``names`` out of ``src_mod`` and append them to ``dst_mod`` with the imports they need;
    ``src_mod`` imports from ``dst_mod`` what it still uses. False if there was nothing to move."""
    src, dst = module_file(src_mod), module_file(dst_mod)
    if not src.exists():
        return False
    text = src.read_text()
    tree = ast.parse(text)
    defs = _top_level_defs(tree)
    nodes = list(dict.fromkeys(defs[n] for n in names if n in defs))
    if not nodes:
        return False
    lines = text.split("\n")
    ends = {id(n): (tree.body[i - 1].end_lineno if i else 0) for i, n in enumerate(tree.body)}
    spans = [_segment(lines, n, ends[id(n)]) for n in nodes]
    moved_code = "\n\n\n".join("\n".join(lines[a - 1:b]) for a, b in spans)
    moved_names = {name for name, node in defs.items() if node in nodes}
    for module, old, new in TOUCH_UPS:
        if module == dst_mod:
            moved_code = moved_code.replace(old, new)
    dst_parent, _, dst_base = dst_mod.rpartition(".")
    if f"from marlaas.{dst_parent} import {dst_base}" in text:  # src used dst as a module: now its own names
        moved_code = re.sub(rf"(?<![\w.]){dst_base}\.(?=[A-Za-z_])", "", moved_code)
    remaining = _replace_lines(text, [(a, b, "") for a, b in spans])
    remaining = re.sub(r"\n{4,}", "\n\n\n", remaining).rstrip("\n") + "\n"

    src_imports, src_defs = _imports(tree), _top_level_defs(tree)
    dst_text = dst.read_text() if dst.exists() else NEW_DOCS.get(dst_mod, '"""TODO."""\n\nfrom __future__ import annotations\n')
    dst_defs = _top_level_defs(ast.parse(dst_text))
    need = []
    extra_defs = []
    for name in sorted(_names_used(ast.parse(moved_code)) - moved_names - set(dst_defs)):
        if name in src_imports:
            need.append(src_imports[name])
        elif name == "log" and name in src_defs:
            extra_defs.append(f'log = structlog.get_logger("marlaas.{dst_mod}")')
            need.append("import structlog")
        elif name in src_defs:
            need.append(f"from marlaas.{src_mod} import {name}")
    dst_text = dst_text.rstrip("\n") + "\n"
    if extra_defs:
        dst_text += "\n" + "\n".join(extra_defs) + "\n"
    dst_text += "\n\n" + moved_code.strip("\n") + "\n"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(_insert_imports(dst_text, need))
    back = sorted(_names_used(ast.parse(remaining)) & moved_names)
    remaining = _insert_imports(remaining, [f"from marlaas.{dst_mod} import {n}" for n in back])
    src.write_text(_drop_unused_imports(remaining))
    sh("git", "add", str(dst), str(src))
    return True


def redirect_names(text: str, src_mod: str, dst_mod: str, names: list[str], own: bool = False) -> str:
    """Imports and dotted paths of ``names`` from ``src_mod`` now point at ``dst_mod`` (``own``:
    the text is ``dst_mod``'s, where those imports go)."""
    moved = set(names)
    text = re.sub(rf"\bmarlaas\.{re.escape(src_mod)}\.({'|'.join(names)})\b",
                  lambda m: f"marlaas.{dst_mod}.{m[1]}", text)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    src_full, dst_full = f"marlaas.{src_mod}", f"marlaas.{dst_mod}"
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == src_full and not node.level:
            going = [a for a in node.names if a.name in moved]
            if not going:
                continue
            staying = [a for a in node.names if a.name not in moved]
            indent = " " * node.col_offset
            new = []
            if staying:
                new.append(_statement(indent, src_full, [_alias_text(a) for a in staying]))
            if not own:
                new.append(_statement(indent, dst_full, [_alias_text(a) for a in going]))
            edits.append((node.lineno, node.end_lineno, "\n".join(new)))
    text = _replace_lines(text, edits)
    # `from marlaas.pkg import module` then `module.name`
    src_parent, _, src_base = src_full.rpartition(".")
    dst_parent, _, dst_base = dst_full.rpartition(".")
    tree = ast.parse(text)
    aliases = [(node, a) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == src_parent and not node.level for a in node.names if a.name == src_base]
    if not aliases:
        return text
    pattern = re.compile(rf"(?<![\w.])({'|'.join({a.asname or a.name for _, a in aliases})})\.({'|'.join(names)})\b")
    if not pattern.search(text):
        return text
    text = pattern.sub(lambda m: f"{dst_base}.{m[2]}", text)
    top_level = any(isinstance(n, ast.ImportFrom) and n.module == dst_parent and
                    any(a.name == dst_base and a.asname is None for a in n.names) for n in tree.body)
    edits = []
    for node, alias in aliases:
        name = alias.asname or alias.name
        still_used = re.search(rf"(?<![\w.]){name}\.", text) is not None
        indent = " " * node.col_offset
        others = [_alias_text(a) for a in node.names if a is not alias or still_used]
        new = [_statement(indent, src_parent, others)] if others else []
        if not (top_level and node.col_offset):
            new.append(f"{indent}from {dst_parent} import {dst_base}")
        edits.append((node.lineno, node.end_lineno, "\n".join(new)))
    return _replace_lines(text, edits)


# Small, explicit edits inside moved code: (module, old text, new text). Each is idempotent.
TOUCH_UPS = [
    ("sdk.discovery", "raise StackError(f\"no running marlaas", "raise StackNotReady(f\"no running marlaas"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the moves, change nothing")
    args = parser.parse_args()
    move_modules(args.dry_run)
    if args.dry_run:
        return
    files = text_files()
    for path in files:
        text = path.read_text(errors="surrogateescape")
        new = rewrite_module_imports(text, MOVES) if path.suffix == ".py" else text
        new = rewrite_paths(rewrite_dotted(new, MOVES), MOVES)
        if new != text:
            path.write_text(new, errors="surrogateescape")
    for src, dst, names, why in SPLITS:
        if move_definitions(src, dst, names):
            print(f"moved {', '.join(names)}: {src} -> {dst} ({why})")
        for path in text_files():
            text = path.read_text(errors="surrogateescape")
            new = redirect_names(text, src, dst, names, path == module_file(dst)) if path.suffix == ".py" else re.sub(
                rf"\bmarlaas\.{re.escape(src)}\.({'|'.join(names)})\b", lambda m: f"marlaas.{dst}.{m[1]}", text)
            if new != text:
                path.write_text(new, errors="surrogateescape")
    for module, old, new in TOUCH_UPS:
        path = module_file(module)
        if path.exists() and old in path.read_text():
            path.write_text(path.read_text().replace(old, new))
    sh("git", "add", "-A", "libs")


if __name__ == "__main__":
    main()
