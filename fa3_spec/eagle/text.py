"""Text in and out for a checkpoint: its own tokenizer, chat template and EOS ids.

The tokenizer is transformers' ``AutoTokenizer`` when transformers is
installed (it also applies chat templates), else the ``tokenizers``
library's ``Tokenizer`` on ``tokenizer.json``; both are the optional extra
``fa3-spec[hf]``. Everything is read from the local directory.
"""

from __future__ import annotations

import json
import pathlib
from typing import List, Optional, Tuple

from .checkpoint import eos_token_ids, read_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class CheckpointTokenizer:
    """Encode prompts and decode completions with a checkpoint's own tokenizer."""

    def __init__(self, tokenizer, *, transformers: bool):
        self._tok = tokenizer
        self.transformers = transformers

    @classmethod
    def load(cls, model_dir) -> Optional["CheckpointTokenizer"]:
        """The directory's tokenizer, or None when it has no tokenizer files or
        neither transformers nor tokenizers is installed."""
        d = pathlib.Path(model_dir).expanduser()
        if not any((d / f).is_file() for f in TOKENIZER_FILES):
            return None
        try:
            from transformers import AutoTokenizer
        except ImportError:
            pass
        else:
            return cls(AutoTokenizer.from_pretrained(str(d), local_files_only=True),
                       transformers=True)
        if not (d / "tokenizer.json").is_file():
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), transformers=False)

    @property
    def has_chat_template(self) -> bool:
        """Whether ``encode(..., chat=True)`` can apply the checkpoint's chat template."""
        return self.transformers and getattr(self._tok, "chat_template", None) is not None

    def encode(self, text: str, *, chat: bool = False) -> List[int]:
        """Token ids of ``text``; ``chat``: as one user turn of the checkpoint's chat
        template, with the assistant's turn opened (needs transformers)."""
        if chat:
            if not self.transformers:
                raise RuntimeError("--chat needs transformers to apply the chat template "
                                   "(pip install 'fa3-spec[hf]')")
            ids = self._tok.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5's default)
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        if self.transformers:
            return [int(t) for t in self._tok.encode(text)]
        return list(self._tok.encode(text).ids)

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def checkpoint_eos_ids(model_dir) -> Tuple[int, ...]:
    """EOS ids of a checkpoint: ``generation_config.json``'s ``eos_token_id`` (one
    id or a list), else ``config.json``'s; empty if neither says. A malformed file
    or id is a `CheckpointError` naming the file and the field."""
    d = pathlib.Path(model_dir).expanduser()
    for name in ("generation_config.json", "config.json"):
        if (d / name).is_file():
            eos = eos_token_ids(read_config(d, name), d / name)
            if eos is not None:
                return eos
    return ()


def read_prompts(path) -> List[Tuple[str, Optional[int]]]:
    """A JSONL file of prompts -> ``(text, max_new_tokens or None)`` per line.

    Each line is a JSON string, or an object with ``"prompt"`` (or ``"text"``)
    and optionally ``"max_new_tokens"``; blank lines are skipped.
    """
    out = []
    for n, line in enumerate(pathlib.Path(path).expanduser().read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if isinstance(item, str):
            out.append((item, None))
            continue
        text = item.get("prompt", item.get("text")) if isinstance(item, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{n}: expected a string or an object with 'prompt'")
        new = item.get("max_new_tokens")
        out.append((text, None if new is None else int(new)))
    return out
