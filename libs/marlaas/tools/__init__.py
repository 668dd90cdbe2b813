"""Tools for agentic jobs: the SDK tenants write tools with, and the registry of served tools.

``from marlaas.tools import tool, reward, serve`` is all a tenant's tool file needs (see
``examples/weather_tool.py``). The env service serves the built-ins (``search``,
``calculator``, ``python``) through the same shell.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# what each name is imported from, when first used: importing a submodule (the tool-call protocol
# rollout parses with) must not load the SDK and the bus behind it
_EXPORTS = {
    "marlaas.tools.registry": ("BUILTIN", "ToolNameError", "announce_tool", "keep_announced", "list_tools",
                               "qualify", "read_tool", "reward_subject", "tool_subject"),
    "marlaas.tools.serving": ("RewardFunction", "ServedTools", "Tool", "ToolError", "reward", "serve", "serve_async",
                          "serve_tools", "tool"),
}
_SOURCE = {name: module for module, names in _EXPORTS.items() for name in names}

DEFAULT_CORPUS = Path(__file__).parent / "data" / "corpus.jsonl"  # the built-in search corpus

__all__ = [
    "BUILTIN", "DEFAULT_CORPUS", "RewardFunction", "ServedTools", "Tool", "ToolError",
    "ToolNameError", "announce_tool", "keep_announced", "list_tools", "qualify", "read_tool",
    "reward", "reward_subject", "serve", "serve_async", "serve_tools", "tool", "tool_subject",
]


def __getattr__(name: str):
    if name not in _SOURCE:
        raise AttributeError(f"module 'marlaas.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCE[name]), name)
    globals()[name] = value
    return value
