"""The built-in demo calibration source is versioned data: intact, reproducible from its
package, and free of golden-set text."""

from __future__ import annotations

import pytest

from quantgate.calibration.build_demo_source import check, golden_texts, package_root
from quantgate.calibration.overlap import ngram_overlap
from quantgate.calibration.sources import demo_source_dir, load_documents
from quantgate.core.artifacts import read_json, verify_files
from quantgate.core.errors import SourceError


def test_snapshot_matches_its_manifest() -> None:
    manifest = read_json(demo_source_dir() / "manifest.json")
    verify_files(demo_source_dir(), manifest["files"], "demo source")
    assert manifest["licence"] == "CC BY-SA 4.0" and "SQuAD" in manifest["attribution"]
    documents = load_documents("demo")
    assert len(documents.texts) == manifest["documents"] > 500


def test_rebuild_reproduces_the_snapshot_sha256() -> None:
    assert check(), "python -m calibration.build_demo_source no longer reproduces calibration/data/demo/v1"


def test_demo_source_does_not_leak_into_the_planned_golden_sets() -> None:
    texts = load_documents("demo").texts
    for name, golden in golden_texts(package_root()).items():
        assert golden, name  # the golden texts were found at all
        assert ngram_overlap(texts, golden, n=13).shared_ngrams == 0, name


def test_unknown_demo_version_is_refused() -> None:
    with pytest.raises(SourceError, match="no version 'v9'"):
        load_documents("demo@v9")
