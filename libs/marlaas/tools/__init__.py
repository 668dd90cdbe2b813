"""Tools for agentic jobs: the SDK tenants write tools with, and the registry of served tools.

``from marlaas.tools import tool, reward, serve`` is all a tenant's tool file needs (see
``examples/weather_tool.py``). The env service serves the built-ins (``search``,
``calculator``, ``python``) through the same shell.
"""

from pathlib import Path

from marlaas.tools.registry import (
    BUILTIN,
    ToolNameError,
    announce_tool,
    keep_announced,
    list_tools,
    qualify,
    read_tool,
    reward_subject,
    tool_subject,
)
from marlaas.tools.sdk import (
    RewardFunction,
    ServedTools,
    Tool,
    ToolError,
    reward,
    serve,
    serve_async,
    serve_tools,
    tool,
)

DEFAULT_CORPUS = Path(__file__).parent / "data" / "corpus.jsonl"  # the built-in search corpus

__all__ = [
    "BUILTIN", "DEFAULT_CORPUS", "RewardFunction", "ServedTools", "Tool", "ToolError",
    "ToolNameError", "announce_tool", "keep_announced", "list_tools", "qualify", "read_tool",
    "reward", "reward_subject", "serve", "serve_async", "serve_tools", "tool", "tool_subject",
]
