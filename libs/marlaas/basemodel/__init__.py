"""The built-in base model: a tiny character-level Qwen3 that half-knows the toy tasks.

``tiny/`` (committed, ~3 MB) holds a float32 ``Qwen3ForCausalLM`` (4 layers, width 128,
head_dim 32, tied embeddings, vocab 128) with its character-level tokenizer
(``<pad>``=0, ``<eos>``=1, ``<unk>``=2, no BOS) and a generation config holding only
token ids. It loads as-is in transformers and vLLM (``dtype="float32"``, LoRA enabled).

It is deliberately *partially* pretrained on the ``addition``, ``reverse`` and ``repeat``
tasks: sampling at temperature 1.0 earns a mean partial-credit reward of about 0.43 on
each, so GRPO groups have reward variance and there is room to improve. Rebuild it with
``python -m marlaas.basemodel.pretrain`` (about a minute on 2 CPU cores, bit-reproducible
on the same machine).
"""

from __future__ import annotations

from pathlib import Path

_TINY = Path(__file__).resolve().parent / "tiny"
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


__all__ = ["builtin_model_dir"]
