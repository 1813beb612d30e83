"""Chat messages are data: special-token text a client writes in a message or a tool description
never becomes a control token of the prompt.

The template renders with every string that holds special-token text replaced by a placeholder;
the rendered markup is then tokenized as usual (its own `<|im_start|>` are control tokens) and each
placeholder's original string with special-token parsing off (`Tokenizer.encode_as_data`).
Requests whose strings hold no such text keep the plain road (the rendered text, tokenized whole).
"""
from __future__ import annotations

import re
from typing import Any, Callable

OPEN, CLOSE = "\ue000", "\ue001"                     # private-use characters: no template writes them
_SLOT = re.compile(f"{OPEN}(\\d+){CLOSE}")


def mask_special_text(value: Any, specials: tuple[str, ...], originals: list[str]) -> Any:
    """`value` (messages, tools: JSON-like) with each string that contains special-token text
    replaced by a placeholder; the strings go to `originals` in placeholder order."""
    if isinstance(value, str):
        if any(sp in value for sp in specials) or OPEN in value or CLOSE in value:
            originals.append(value)
            return f"{OPEN}{len(originals) - 1}{CLOSE}"
        return value
    if isinstance(value, dict):
        return {k: mask_special_text(v, specials, originals) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_special_text(v, specials, originals) for v in value]
    return value


def encode_masked(text: str, originals: list[str], encode: Callable[[str], list[int]],
                  encode_data: Callable[[str], list[int]]) -> list[int] | None:
    """Ids of a rendered prompt whose placeholders stand for `originals`; None when the template
    did not keep every placeholder intact (it escaped or cut one), so content cannot be told apart."""
    pieces = _SLOT.split(text)
    found = [int(i) for i in pieces[1::2]]
    if sorted(set(found)) != list(range(len(originals))) or OPEN in "".join(pieces[::2]) or CLOSE in "".join(pieces[::2]):
        return None
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += encode_data(originals[int(piece)])
        elif piece:
            ids += encode(piece)
    return ids
