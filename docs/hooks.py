"""mkdocs hook: the reference tables are generated from the code at every build, so they cannot
drift. A page asks for one with a marker line:

    <!-- reference: config -->   every setting of marlaas.platform.config.Config, by section
    <!-- reference: job -->      every field of a job file (marlaas.platform.api.SubmitRequest)
    <!-- reference: http -->     every endpoint of the tenants' API, from the gateway's OpenAPI schema
    <!-- reference: sdk -->      marlaas.Client's methods, from their signatures and docstrings
    <!-- reference: tools -->    what a tool file uses: marlaas.tools' tool, reward, serve, ToolError

For the structs, each row is a field: its name, type, default, and the comment beside it (or
the comment block just above it) in the source.
"""
from __future__ import annotations

import inspect
import re
import typing

import msgspec

MARKER = re.compile(r"^<!-- reference: (\w+) -->$", re.M)


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its source comment: the one beside it, else the comment lines above it. Lines
    between two fields that both have one beside them continue the first one's."""
    found, block, previous = {}, [], None
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("# "))
            continue
        field = re.match(r"(\w+): [^=]+(?:=.*?)?(?:#\s*(.*))?$", stripped)
        if not field or stripped.startswith(("def ", "class ", "@", "return")):
            block, previous = [], None
            continue
        if field[2]:
            if block and previous is not None:
                found[previous] += " " + " ".join(block)
            found[field[1]] = field[2]
            previous = field[1]
        else:
            found[field[1]] = " ".join(block)
            previous = None
        block = []
    return found


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        return f"`{field.default!r}`"
    if field.default_factory is not msgspec.NODEFAULT:
        return "(a section)" if isinstance(field.default_factory, type) else f"`{field.default_factory()!r}`"
    return "required"


def _type(field: msgspec.structs.FieldInfo) -> str:
    kind = field.type
    if typing.get_origin(kind) is typing.Annotated:  # a bound: the field's own error names it
        kind = typing.get_args(kind)[0]
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(f"`{v!r}`" for v in typing.get_args(kind))
    text = kind.__name__ if isinstance(kind, type) else str(kind)
    return text.replace("|", "or")


def table(cls: type, prefix: str = "") -> list[str]:
    """Rows for ``cls``'s fields; a nested struct becomes its own rows, named ``prefix.field``."""
    rows, notes = [], _comments(cls)
    for field in msgspec.structs.fields(cls):
        factory = field.default_factory
        if isinstance(factory, type) and issubclass(factory, msgspec.Struct):
            rows += table(factory, f"{prefix}{field.name}.")
            continue
        note = notes.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{prefix}{field.name}` | {_type(field)} | {_default(field)} | {note} |")
    return rows


def http_reference() -> str:
    """The tenants' endpoints (``/v1``) as the gateway's schema describes them."""
    import types

    from marlaas.platform.config import Config
    from services.gateway.app import create_app
    from services.gateway.operations import api_schema

    schema = api_schema(create_app(types.SimpleNamespace(config=Config())))
    rows = ["| method | path | what it does | answers |", "|---|---|---|---|"]
    for path, operations in schema["paths"].items():
        if not path.startswith("/v1/"):
            continue  # /schema: the operator's
        for method, op in operations.items():
            codes = ", ".join(sorted(op.get("responses", {})))
            rows.append(f"| {method.upper()} | `{path}` | {op.get('summary', '')} | {codes} |")
    return "\n".join(rows) + "\n"


def sdk_reference() -> str:
    """``marlaas.Client``'s public methods: signature and the first paragraph of the docstring."""
    from marlaas.sdk.http import Client

    parts = []
    for name, member in inspect.getmembers(Client):
        if name.startswith("_") or not (inspect.isfunction(member) or inspect.ismethod(member)):
            continue
        function = getattr(member, "__func__", member)  # a classmethod: from_env
        try:
            signature = inspect.signature(function, eval_str=True)
        except NameError:  # an annotation only the type checker knows
            signature = inspect.signature(function)
        doc = (inspect.getdoc(function) or "").split("\n\n")[0].replace("\n", " ")
        parts.append(f"- `Client.{name}{signature}`" + (f": {doc}" if doc else ""))
    return "\n".join(parts) + "\n"


def tools_reference() -> str:
    """What a tenant's tool file uses, each with its signature and whole docstring."""
    from marlaas import tools

    parts = []
    for name in ("tool", "reward", "serve", "serve_async", "ToolError"):
        member = getattr(tools, name)
        head = f"class {name}" if inspect.isclass(member) else f"{name}{inspect.signature(member)}"
        doc = inspect.getdoc(member) or ""
        parts.append(f"### `{head}`\n\n{doc}\n")
    return "\n".join(parts)


def reference(name: str) -> str:
    if name == "http":
        return http_reference()
    if name == "sdk":
        return sdk_reference()
    if name == "tools":
        return tools_reference()
    if name == "config":
        from marlaas.platform.config import Config as root
    elif name == "job":
        from marlaas.platform.api import SubmitRequest as root
    else:
        raise ValueError(f"unknown reference {name!r}: config, job, http, sdk or tools")
    return "\n".join(["| field | type | default | what it is |", "|---|---|---|---|", *table(root)]) + "\n"


def on_page_markdown(markdown: str, **_) -> str:
    return MARKER.sub(lambda m: reference(m[1]), markdown)
