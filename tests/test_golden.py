"""Behaviour recorded before the storage/protocol redesign (tests/golden/record.py) is unchanged after it: for every
policy family, the greedy tokens, every kept token set and the bytes held."""

import json
from pathlib import Path

import pytest

from golden.record import smol_cases, tiny_cases

RECORDED = json.loads((Path(__file__).parent / "golden" / "behaviour.json").read_text())


def _check(key, run):
    assert key in RECORDED, f"{key} was never recorded; run tests/golden/record.py before changing behaviour"
    assert run() == RECORDED[key]


@pytest.mark.parametrize("key, run", list(tiny_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_tiny_models_behave_as_recorded(key, run):
    _check(key, run)


@pytest.mark.real_model
@pytest.mark.parametrize("key, run", list(smol_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_smollm2_behaves_as_recorded(key, run):
    _check(key, run)
