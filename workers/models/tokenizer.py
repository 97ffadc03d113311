"""Character-level tokenizer for the tiny model.

Id 0 is padding, 1 is end-of-sequence; characters of the alphabet follow in order.
An unknown character is an error naming it (never silently mapped to something).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAD_ID = 0
EOS_ID = 1
_SPECIALS = 2

#: Digits, a few operators and lowercase letters: enough for the built-in tasks.
DEFAULT_ALPHABET = "0123456789+-*=:>?, abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class CharTokenizer:
    alphabet: str = DEFAULT_ALPHABET
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("tokenizer alphabet has repeated characters")
        object.__setattr__(
            self, "_index", {c: i + _SPECIALS for i, c in enumerate(self.alphabet)}
        )

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + _SPECIALS

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} in {text!r} is not in the tokenizer alphabet "
                f"{self.alphabet!r}"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Decode up to the first EOS; padding is skipped."""
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i >= _SPECIALS:
                out.append(self.alphabet[i - _SPECIALS])
        return "".join(out)
