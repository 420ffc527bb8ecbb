"""The n-gram leakage check on texts with known answers."""

from __future__ import annotations

import pytest

from quantgate.calibration import ngram_overlap
from quantgate.core.errors import InputError


def test_identical_text_overlaps_fully() -> None:
    text = "one two three four five six"
    result = ngram_overlap([text], [text], n=3)
    assert (result.candidate_ngrams, result.shared_ngrams, result.share) == (4, 4, 1.0)


def test_known_partial_overlap_ignores_case_and_punctuation() -> None:
    calibration = ["Alpha beta gamma delta epsilon"]  # 3-grams: abg, bgd, gde
    golden = ["noise ALPHA, beta; gamma! and more", "gamma delta epsilon"]
    result = ngram_overlap(calibration, golden, n=3)
    assert result.candidate_ngrams == 3
    assert result.shared_ngrams == 2
    assert result.share == pytest.approx(2 / 3)


def test_ngrams_do_not_span_documents() -> None:
    result = ngram_overlap(["a b c d"], ["a b", "c d"], n=3)
    assert result.shared_ngrams == 0


def test_text_shorter_than_n_has_no_ngrams_and_zero_share() -> None:
    result = ngram_overlap(["too short"], ["too short"], n=13)
    assert (result.candidate_ngrams, result.share) == (0, 0.0)


def test_bad_n_is_an_error() -> None:
    with pytest.raises(InputError):
        ngram_overlap(["a"], ["a"], n=0)
