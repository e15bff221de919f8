"""Config and policy TOML are data, bounded before they are parsed (torchcls.toml_files).

Properties (hypothesis): any TOML document or text, loaded through the real config loader (then its hooks
resolved) or the policy loader, either loads or raises UserError, imports no module, and stays within
time; a well-formed document is read exactly as tomllib reads it (the bounds refuse nothing real).
Bombs (a child process, memory-capped): each is refused in bounded time and memory with a UserError.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from torchcls.config import SECTIONS, Config, load_toml
from torchcls.errors import UserError
from torchcls.governance.hooks import resolve_hooks
from torchcls.governance.policy import Policy, load_policy
from torchcls.toml_compat import tomllib
from torchcls.toml_files import MAX_DOTS_PER_LINE, MAX_NESTING, MAX_TOML_BYTES, read_toml

REPO = Path(__file__).resolve().parents[1]
PROPERTY = settings(max_examples=120, deadline=dt.timedelta(seconds=3),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Strings an attacker would try: module paths, import expressions, YAML/pickle-style tags, hook names.
SPICY = st.sampled_from(["this:x", "os:system", "runs.alice_run.hook:h", "a.b.c", "__import__('os')", "pickle:loads",
                         "!!python/object/apply:os.system", "${HOME}", "::", "..", "strip-exif", "strip-exif,this:x",
                         "mypkg.faces:blur_faces", "importlib:import_module"])
OPTION_NAMES = sorted({f.name for cls in SECTIONS.values() for f in fields(cls)})
POLICY_WORDS = ["policy", "processing", "data", "outputs", "hooks", "residency", "name", "allowed_regions",
                "allowed_licenses", "personal", "EU", "restricted_tags", "max_retention_days"]
KEYS = st.sampled_from([*SECTIONS, *OPTION_NAMES, *POLICY_WORDS]) | st.text(min_size=1, max_size=12)
SCALARS = (st.text(alphabet=st.characters(codec="utf-8"), max_size=30) | SPICY | st.booleans()
           | st.integers(min_value=-(2**200), max_value=2**200) | st.sampled_from([2**63, -(2**63) - 1, 10**4000])
           | st.floats(allow_nan=False) | st.dates() | st.datetimes())
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=20)
DOCUMENTS = st.dictionaries(KEYS, st.dictionaries(KEYS, VALUES, max_size=6) | VALUES, max_size=6)
# Text that is TOML-ish but mostly not TOML: brackets, quotes, dots, escapes, comments, newlines.
# And runs of one token, long enough to reach the parser's limits (nesting, digits, dotted keys).
TOKENS = ["x = ", "[", "]", "{a=", "}", "a.", ".a", "1", "\n", '"', "'''", "[[t]]\n", "#"]
RUNS = st.builds(lambda head, runs: head + "".join(runs), st.sampled_from(["", "x = ", "[t]\nx = "]),
                 st.lists(st.builds(lambda tok, n: tok * n, st.sampled_from(TOKENS), st.integers(0, 6000)),
                          min_size=1, max_size=4))
TEXTS = st.text(alphabet='[]{}."\'#=\\\n :ab1_-,+eE\t\u00e9', max_size=400) | RUNS


def _serialized(doc: dict) -> str:
    try:
        return tomli_w.dumps(doc)
    except (TypeError, ValueError):  # what TOML cannot hold (tomli_w's own limits): not a test case
        assume(False)
        raise


def _load_config(path: Path) -> Config | None:
    """The config loader and then hook resolution, as `train --config` runs them; None when refused."""
    try:
        cfg = load_toml(path)
        resolve_hooks(cfg.governance.hooks)
    except UserError:
        return None
    return cfg


def _load_policy(path: Path) -> Policy | None:
    try:
        return load_policy(path)
    except UserError:
        return None


LOADERS = {"config": _load_config, "policy": _load_policy}


def _check_no_import(loader, path: Path) -> None:
    loader(path)  # warm: the first call may import torchcls's own lazy parts
    before = set(sys.modules)
    loader(path)
    assert set(sys.modules) == before


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("toml") / "doc.toml"


@pytest.mark.parametrize("kind", list(LOADERS))
@PROPERTY
@given(doc=DOCUMENTS)
def test_any_document_loads_or_is_refused_and_imports_nothing(kind, doc, scratch):
    scratch.write_text(_serialized(doc))
    _check_no_import(LOADERS[kind], scratch)


@pytest.mark.parametrize("kind", list(LOADERS))
@PROPERTY
@given(text=TEXTS)
def test_any_text_loads_or_is_refused_and_imports_nothing(kind, text, scratch):
    scratch.write_text(text)
    _check_no_import(LOADERS[kind], scratch)


@PROPERTY
@given(spec=st.lists(SPICY | st.text(alphabet="thisx:._-/ ,", max_size=12), max_size=4).map(",".join),
       extra=st.dictionaries(st.sampled_from(OPTION_NAMES), VALUES, max_size=3))
def test_any_hooks_value_in_a_config_imports_nothing(spec, extra, scratch):
    """`[governance] hooks`, the option that once named code: whatever it holds, nothing is imported."""
    scratch.write_text(_serialized({"governance": {**extra, "hooks": spec}}))
    _check_no_import(_load_config, scratch)
    assert "this" not in sys.modules


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@PROPERTY
@given(doc=DOCUMENTS)
def test_a_well_formed_document_is_read_as_tomllib_reads_it(doc, scratch):
    text = _serialized(doc)
    assume(len(text.encode()) <= MAX_TOML_BYTES)
    scratch.write_text(text)
    assert _same(read_toml(scratch, "config file"), tomllib.loads(text))


# --- bombs: each refused, in bounded time and memory --------------------------------------------------

def _worst_allowed() -> str:
    """As many lines of MAX_DOTS_PER_LINE dotted-key parts as fit: the most tomllib is ever given."""
    line = ".a" * MAX_DOTS_PER_LINE + " = 1\n"
    return "".join(f"k{i}{line}" for i in range(MAX_TOML_BYTES // (len(line) + 6)))


BOMBS = {  # name -> (text, what the refusal says); each under MAX_TOML_BYTES unless it tests that bound
    "dotted key (O(k^2) in tomllib)": ("a" + ".a" * 100_000 + " = 1\n", "dotted-key parts"),
    "dotted table header": ("[" + "a." * 100_000 + "a]\n", "dotted-key parts"),
    "nested arrays (RecursionError)": ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "more than 32 deep"),
    "nested inline tables": ("x = " + "{a=" * 60_000 + "1" + "}" * 60_000 + "\n", "more than 32 deep"),
    "a bomb hidden after a string with 5 quotes": ('k = """a""""" # " """\n' + "b" + ".b" * 100_000 + " = 1\n"
                                                   '"""\n', "dotted-key parts"),
    "integer of 5000 digits (ValueError)": ("[train]\nepochs = " + "1" * 5000 + "\n", "Exceeds the limit"),
    "lone surrogate escape": ('[run]\nname = "\\ud800"\n', "not a Unicode scalar value"),
    "not UTF-8": ("[run]\nname = 'caf\udce9'\n", "UTF-8"),  # written as the byte 0xE9 alone
    "too big": ("# " + "x" * MAX_TOML_BYTES + "\n", f"{MAX_TOML_BYTES} bytes"),
    "the worst it allows": (_worst_allowed(), "unknown"),  # parsed (bounded), then refused: unknown section k0
}
_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))  # a regression fails, not the machine
    from torchcls.config import load_toml
    from torchcls.errors import UserError
    from torchcls.governance.policy import load_policy
    out = {}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, path in json.loads(sys.argv[1]).items():
        for loader in (load_toml, load_policy):
            t = time.perf_counter()
            try:
                loader(path)
                result = "loaded"
            except UserError as e:
                result = "UserError: " + str(e)[:300]
            out[name + " / " + loader.__name__] = [result, time.perf_counter() - t]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"cases": out, "grown_mb": grown}))
""")


def test_bombs_are_refused_in_bounded_time_and_memory(tmp_path):
    paths = {}
    for i, (name, (text, _)) in enumerate(BOMBS.items()):
        paths[name] = str(tmp_path / f"bomb{i}.toml")
        Path(paths[name]).write_bytes(text.encode("utf-8", "surrogateescape"))
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # a config path that is a FIFO: refused, never opened for reading (no hang)
    paths["fifo"] = str(fifo)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(paths)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (result, seconds) in report["cases"].items():
        name = case.split(" / ")[0]
        assert result.startswith("UserError"), case
        assert name == "fifo" or BOMBS[name][1] in result, (case, result)
        assert seconds < 5, (case, seconds)  # the worst allowed parses in about 0.5 s on a 2-core CPU
    assert report["grown_mb"] < 300, report["grown_mb"]  # about 50 MB for the worst allowed; GBs unbounded


def test_the_bounds_leave_room_for_real_files(tmp_path):
    """A run dir's config.toml (every option, as training writes it) and the policy of docs/governance.md
    are far inside every bound, and read as they were written."""
    cfg = Config()
    cfg.governance.hooks, cfg.data.mixup, cfg.optim.lr = "strip-exif,redact-samples", 0.2, 3e-3
    cfg.save_toml(tmp_path / "config.toml")
    doc = (REPO / "docs" / "governance.md").read_text()
    (tmp_path / "policy.toml").write_text(doc.split("<<'TOML'\n", 1)[1].split("TOML\n", 1)[0])
    for name in ("config.toml", "policy.toml"):
        text = (tmp_path / name).read_text()
        assert len(text.encode()) < MAX_TOML_BYTES // 20, name
        assert max(line.count(".") for line in text.splitlines()) < MAX_DOTS_PER_LINE // 4, name
        assert max(line.count("[") for line in text.splitlines()) < MAX_NESTING // 4, name
    assert load_toml(tmp_path / "config.toml").to_dict() == cfg.to_dict()
    assert load_policy(tmp_path / "policy.toml").hooks["personal"] == ["strip-exif", "redact-samples"]
