"""The built-in base model: a tiny character-level Qwen3 that half-knows the toy tasks.

``tiny/`` (committed, ~3 MB) holds a float32 ``Qwen3ForCausalLM`` (4 layers, width 128,
head_dim 32, tied embeddings, vocab 128) with its character-level tokenizer
(``<pad>``=0, ``<eos>``=1, ``<unk>``=2, no BOS) and a generation config holding only
token ids. It loads as-is in transformers and vLLM (``dtype="float32"``, LoRA enabled).

It knows the ``addition``, ``reverse`` and ``repeat`` tasks (greedy reward ~1.0) but is
deliberately under-confident: it was pretrained with label smoothing over each task's
answer alphabet, so sampling at temperature 1.0 earns a mean partial-credit reward of only
about 0.45. GRPO groups therefore have reward variance, and RL has a quick, real gain to
make (sharpening the policy). It also half-knows the tool-call convention: on the agentic
``multiply`` task it was taught to call the calculator (``<tool_call>{...}</tool_call>``, then
copy the ``<tool_response>``) on a third of its examples and to guess on the rest, so it calls
the tool on ~30 % of samples and RL teaches it to call it always. Rebuild it with
``python -m marlaas.basemodel.pretrain`` (about five minutes on 2 CPU cores, reproducible on
the same machine).

``chat/`` (committed) is the chat base that will replace it (issue 25, phase 2): a byte-level
BPE tokenizer with Qwen3's special tokens and a Hermes-shaped chat template that renders tool
schemas, and a small Qwen3 pretrained on tool use with thousands of made-up tools
(``python -m marlaas.basemodel.pretrain_chat``; docs/basemodel.md). It is not the default yet.
"""

from __future__ import annotations

from pathlib import Path

_TINY = Path(__file__).resolve().parent / "tiny"
_CHAT = Path(__file__).resolve().parent / "chat"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def builtin_model_dir() -> Path:
    """The directory of the committed tiny base model (a transformers/vLLM model dir)."""
    missing = [name for name in _FILES if not (_TINY / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the built-in base model is missing from {_TINY} (no {', '.join(missing)}); "
            "build it with `python -m marlaas.basemodel.pretrain`"
        )
    return _TINY


def chat_model_dir() -> Path:
    """The directory of the committed chat base (BPE, chat template, tool use; not the default yet)."""
    missing = [name for name in _FILES + ("chat_template.jinja", "generation_config.json")
               if not (_CHAT / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the chat base model is missing from {_CHAT} (no {', '.join(missing)}); "
            "build it with `python -m marlaas.basemodel.pretrain_chat`"
        )
    return _CHAT


__all__ = ["builtin_model_dir", "chat_model_dir"]
