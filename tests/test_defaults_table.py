"""docs/results/defaults/summary.md lists each measured policy's defaults: they are the code's (a default changed
without its table, or the table without the code, fails here)."""

import re
from pathlib import Path

import kvpress
from kvpress.policies import resolve_policy

TABLE = (Path(__file__).parent.parent / "docs" / "results" / "defaults" / "summary.md").read_text()


def _rows():
    for line in TABLE.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("policy", "---") and "=" in cells[1]:
            yield cells[0], cells[1]


def _value(text: str):
    return {"None": None, "True": True, "False": False}.get(text, int(text) if text.isdigit() else
                                                           float(text) if re.fullmatch(r"\d+\.\d+", text) else text)


def test_the_table_holds_the_codes_defaults():
    rows = list(_rows())
    assert len(rows) >= 10
    for policy, defaults in rows:
        settings = dict(item.split("=") for item in defaults.replace("`", "").split() if "=" in item)
        if policy == "(none named)":
            assert defaults.split("`")[1] == kvpress.DEFAULT_POLICY
            assert {k: _value(v) for k, v in settings.items()} == kvpress.DEFAULT_PARAMS
            continue
        made = _made(policy)
        for name, text in settings.items():
            assert getattr(made, name) == _value(text), (policy, name, getattr(made, name), text)


def _made(policy):
    try:
        return resolve_policy(policy)
    except ValueError:  # an evictor asks for a budget
        return resolve_policy(policy, compression_ratio=0.5)
