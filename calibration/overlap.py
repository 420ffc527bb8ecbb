"""Leakage check: the share of a calibration set's word n-grams that also occur in a text
collection (a golden set). 13-grams follow the GPT-3 paper's contamination analysis
(Brown et al., 2020, appendix C); words are lower-cased runs of letters and digits, so the
check does not depend on the tokenizer."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from quantgate.core.errors import InputError

DEFAULT_N = 13
_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(texts: Iterable[str], n: int) -> set[str]:
    """Unique word n-grams of every text (n-grams never span two texts)."""
    found: set[str] = set()
    for text in texts:
        tokens = words(text)
        for start in range(len(tokens) - n + 1):
            found.add(" ".join(tokens[start : start + n]))
    return found


@dataclass(frozen=True)
class Overlap:
    n: int
    candidate_ngrams: int  # unique n-grams in the calibration texts
    shared_ngrams: int  # of those, how many occur in the collection

    @property
    def share(self) -> float:
        """Shared / candidate; 0.0 when the candidate has no n-gram at all."""
        return self.shared_ngrams / self.candidate_ngrams if self.candidate_ngrams else 0.0


def ngram_overlap(candidate: Iterable[str], collection: Iterable[str], n: int = DEFAULT_N) -> Overlap:
    """How much of `candidate` (calibration texts) appears in `collection` (e.g. a golden set)."""
    if n < 1:
        raise InputError(f"n-gram size must be at least 1, got {n}")
    candidate_grams = ngrams(candidate, n)
    collection_grams = ngrams(collection, n)
    return Overlap(n, len(candidate_grams), len(candidate_grams & collection_grams))
