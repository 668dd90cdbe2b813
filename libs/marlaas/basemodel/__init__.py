"""The built-in base models, built by the project and committed.

``chat/`` is the default (``base_model = ""``): a Qwen3-architecture model of 1 M parameters
shaped like the real ones users bring: a byte-level BPE tokenizer with Qwen3's special tokens,
a Hermes-shaped chat template that renders each tool's JSON schema in the system turn, and
pretraining on tool use with thousands of made-up tools, so that it calls a tool it has never
seen from its description alone in about a fifth of sampled episodes (RL sharpens that). It
also half-knows the toy tasks in chat form. Rebuild it with ``python -m marlaas.basemodel.pretrain``
(docs/basemodel.md: the data, the figures, reproducibility).

``tiny/`` (``base_model = "builtin:char"``, with ``rollout.prompt_format = "bare"``) is the
first base: character-level, no chat template, taught bare ``<tool_call>`` tags for the
``calculator`` only, deliberately under-confident on the toy tasks (label smoothing). Kept for
comparison and for the figures measured on it; rebuild it with
``python -m marlaas.basemodel.pretrain_char``.
"""

from __future__ import annotations

from pathlib import Path

_TINY = Path(__file__).resolve().parent / "tiny"
_CHAT = Path(__file__).resolve().parent / "chat"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# the names ``base_model`` accepts for the committed models
BUILTIN = {"builtin:chat": "chat", "builtin:char": "char"}


def _checked(root: Path, files: tuple[str, ...], build: str) -> Path:
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the built-in base model is missing from {root} (no {', '.join(missing)}); "
            f"build it with `python -m marlaas.basemodel.{build}`"
        )
    return root


def builtin_model_dir() -> Path:
    """The default base: the chat model's directory (BPE, chat template, tool use)."""
    return _checked(_CHAT, _FILES + ("chat_template.jinja", "generation_config.json"), "pretrain")


def char_model_dir() -> Path:
    """The character-level base's directory (no chat template; ``base_model = "builtin:char"``)."""
    return _checked(_TINY, _FILES, "pretrain_char")


__all__ = ["BUILTIN", "builtin_model_dir", "char_model_dir"]
