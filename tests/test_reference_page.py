"""docs/reference.md is written by hand; its signatures and options tables are the code's: every preset's own
arguments with their defaults, every option shared by the presets, every keyword the torch optimizer adds to
Horovod's, each with its default."""

import inspect
import re
from pathlib import Path

import pytest

import hvd_sparse
from hvd_sparse.compression import TRAINING_OPTIONS
from hvd_sparse.bench import presets

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def section(title):
    start = REFERENCE.index(f"## {title}\n")
    end = REFERENCE.find("\n## ", start + 1)
    return REFERENCE[start:end if end >= 0 else len(REFERENCE)]


def tables(text):
    """Each Markdown table of ``text``: its rows (header and rule left out) as lists of stripped cells."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            found.append(rows[2:])
            rows = []
    return found


def shown(value):
    """A default as the reference writes it: strings in double quotes, the rest as Python prints them."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def options(table):
    """``{name: default}`` of an options table (a row may name several options with as many defaults)."""
    out = {}
    for name_cell, default_cell, _ in table:
        names = re.findall(r"`(\w+)`", name_cell)
        defaults = [d.strip() for d in default_cell.split(",")] if len(names) > 1 else [default_cell]
        defaults = [d.strip("`") for d in (defaults if len(defaults) == len(names) else [default_cell] * len(names))]
        out.update(zip(names, defaults))
    return out


#: the options every preset takes besides its own (the first options table)
SHARED = ("density", "byte_budget", *TRAINING_OPTIONS)


def own_signature(preset):
    """``preset(<its own arguments>)`` as the reference's presets table writes it: ``density`` first and without
    its default, the shared options left out, ``*`` before the keyword-only ones."""
    params = inspect.signature(getattr(hvd_sparse.Compression, preset)).parameters.values()
    parts, star = [], False
    for p in params:
        if p.name in SHARED and p.name != "density":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.name == "density" else f"{p.name}={shown(p.default)}")
    return f"{preset}({', '.join(parts)})"


def test_every_preset_row_is_its_signature():
    rows = tables(section("Presets"))[0]
    written = [re.fullmatch(r"`(.+)`", r[0])[1] for r in rows]
    names = [w.split("(")[0] for w in written]
    assert sorted(names) == sorted(presets.names())
    assert written == [own_signature(n) for n in names]


def test_the_shared_options_are_every_presets_with_their_defaults():
    table = options(tables(section("Options"))[0])
    assert sorted(table) == sorted(SHARED)
    for preset in ("topka", "oktopk", "exdyna"):
        params = inspect.signature(getattr(hvd_sparse.Compression, preset)).parameters
        for name in SHARED:
            if name not in ("density", "byte_budget"):          # "(exactly one)"
                assert table[name] == shown(params[name].default), (preset, name)


def test_the_torch_optimizers_options_are_its_keywords_with_their_defaults():
    torch_optimizer = pytest.importorskip("hvd_sparse.torch.optimizer")
    import hvd_sparse.torch as hvds

    params = inspect.signature(hvds.DistributedOptimizer).parameters
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    resolved = dict(zip(("bucket_cap_mb", "min_compression_rate", "bucket_budget"),
                        torch_optimizer.check_overlap(True, None, None, "api")))
    table = options(tables(section("Options"))[1])
    assert sorted(table) == sorted(keywords)
    for name, default in keywords.items():
        want = resolved[name] if default is None and name in resolved else default
        whole = isinstance(want, float) and want.is_integer() and name == "bucket_cap_mb"   # written "25"
        assert table[name] == (shown(int(want)) if whole else shown(want)), name
