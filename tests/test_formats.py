"""The format registry (quantgate.core.formats): each format declared once, and every table the
stages read (presets, serving tables, precision classes, the plan's per-class fields) derived from it."""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from quantgate.core import formats
from quantgate.core.formats import FORMATS, PRECISION_CLASSES, Computes, Expectation, PrecisionClass, precision_class
from quantgate.quantize.measure.layouts import checked_layout
from quantgate.serving import device

PACKAGE = Path(formats.__file__).resolve().parent.parent  # quantgate/, its stage folders linked in
REGISTRY = Path(formats.__file__).resolve()


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_formats_precision_class_follows_from_its_weight_bits(name: str) -> None:
    entry = FORMATS[name]
    assert entry.precision is precision_class(int(entry.weights["num_bits"]))
    assert entry.precision is (PrecisionClass.four_bit if entry.bits <= 4 else PrecisionClass.eight_bit)


def test_the_precision_classes_are_the_policy_keys() -> None:
    from quantgate.gates.policy import load_policy

    assert [str(precision) for precision in PRECISION_CLASSES] == ["8bit", "4bit"]  # the policy YAML files' keys
    bounds = load_policy("default").policy.metrics
    keys = {key for by_metric in bounds.values() for gate in by_metric.values() for key in getattr(gate, gate.kind)}
    assert keys <= set(PRECISION_CLASSES)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_entry_is_the_compressed_tensors_preset_it_names(name: str) -> None:
    """The arguments are written out (compressed-tensors is not imported by the CLI): they must
    agree with the preset the entry names, but for the fields it says it sets otherwise."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    entry = FORMATS[name]
    variants = [(entry.scheme, *entry.args())]
    if entry.dynamic_scheme is not None:
        variants.append((entry.dynamic_scheme, *entry.args(dynamic=True)))
    for scheme, weights, activations in variants:
        preset = PRESET_SCHEMES[scheme]
        for ours, theirs in ((weights, preset["weights"]), (activations, preset.get("input_activations"))):
            assert (ours is None) == (theirs is None), f"{name} ({scheme}): input activations differ from the preset's"
            if ours is None or theirs is None:
                continue
            for key, value in ours.items():
                if key in ("observer",) or key in entry.overrides:
                    continue
                assert str(getattr(theirs, key).value if hasattr(getattr(theirs, key), "value") else getattr(theirs, key)) == str(value), (
                    f"{name} ({scheme}): {key} {value!r} is not the preset's")
            if "strategy" not in entry.overrides and theirs.strategy == "group":
                assert entry.grouped, f"{name}: the preset groups its weights"


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_formats_layout_is_one_the_accounting_checks(name: str) -> None:
    assert checked_layout(FORMATS[name].layout) is not None


def test_the_serving_tables_are_the_registrys() -> None:
    assert device.SCHEMES == formats.served_schemes()
    assert set(device.SCHEMES) >= {"W4A16", "W8A8", "FP8", "FP8_DYNAMIC"}
    for rule in device.RULES:
        assert any(fact.computes is Computes.serves_as and fact.source == rule.source for entry in FORMATS.values() for fact in entry.serving)
    for gap in device.KNOWN_GAPS:
        assert any(fact.computes.gap and fact.source == gap.source for entry in FORMATS.values() for fact in entry.serving)


@pytest.fixture
def registry_with(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Add an entry to the registry and rebuild serving.device's tables from it (restored after)."""

    def add(entry: formats.Format) -> None:
        monkeypatch.setitem(FORMATS, entry.name, entry)
        importlib.reload(device)

    yield add
    monkeypatch.undo()
    importlib.reload(device)


def test_a_new_entry_shows_in_the_serving_tables(registry_with: object) -> None:
    source = "a test's fact"
    entry = replace(FORMATS["gptq-int4"], name="int3-test", weights={"num_bits": 3, "type": "int", "symmetric": True, "strategy": "group"},
                    serving=(Expectation(device.AVX512, Computes.no_kernel, source),))
    registry_with(entry)
    assert "W3A16" in device.SCHEMES
    assert [(gap.scheme, gap.what, gap.source) for gap in device.known_gaps("vllm-cpu", device.AVX512, ["W3A16"])] == [
        ("W3A16", "no kernel", source)]
    assert "quantgate-serves-W3A16" not in device.node_resources("vllm-cpu", device.AVX512)
    assert "quantgate-serves-W3A16" in device.node_resources("vllm-cpu", device.AVX2)  # no fact there: expected to serve
    assert entry.precision is PrecisionClass.four_bit


def test_the_int4_engine_rule_is_the_registrys() -> None:
    (rule,) = device.default_differs("vllm-cpu", device.AVX512_AMX, ["W4A16"])
    fact = next(fact for fact in FORMATS["gptq-int4"].serving if fact.computes is Computes.serves_as)
    assert (rule.default_scheme, rule.setting, rule.source) == (fact.served_as, fact.setting, fact.source)


def test_the_plans_discordance_takes_every_precision_class() -> None:
    from quantgate.pipeline.plan import DiscordancePrior

    given = DiscordancePrior.model_validate({**{str(precision): 0.1 for precision in PRECISION_CLASSES}, "source": "a test"})
    assert given.values == {str(precision): 0.1 for precision in PRECISION_CLASSES}


def _package_sources() -> Iterator[Path]:
    for folder, _, files in os.walk(PACKAGE, followlinks=True):
        yield from (Path(folder) / name for name in files if name.endswith(".py"))


def test_no_precision_class_literal_outside_the_registry() -> None:
    """A precision class is spelled once, in quantgate.core.formats: every other module derives
    it from a format's bits (grep -rn '4bit\\|8bit' quantgate finds the registry alone)."""
    literal = re.compile(r"[0-9]+bit\b")
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for path in _package_sources() if path.resolve() != REGISTRY
             for number, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    sources = list(_package_sources())
    assert any(path.resolve() == REGISTRY for path in sources) and len(sources) > 50  # the walk saw the package
    assert found == []
