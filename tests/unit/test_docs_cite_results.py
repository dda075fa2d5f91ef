"""The docs' measured numbers are their JSONs' numbers.

Every result file that README.md and docs/ cite is committed, and every measured number in README.md and
docs/MEASURED.md (all of both) is held to the committed result it came from through the registry
``docs_numbers.json`` next to this file. docs/USING.md (the node's full reference, moved out of the README)
quotes no measurement: it is in the registry with no numbers, so a measured number written there fails until
it moves to MEASURED.md. Per doc it has three lists:

- ``numbers``: one entry per quoted number. ``phrase``: the words around it as the doc writes them (found
  once in the doc, whitespace runs as one space), the number marked ``[[...]]``; ``json``: the file under
  bench/results/ (or a path from the repository root, e.g. safe_ops/facts/kernel_table.json; ``rev``: as
  that commit has it) or ``log``: a log under bench/results/ with a ``pattern``; ``field``: where in the
  JSON (``resolve``); then what is done to it (``value``: ``minus``, ``over``, ``ops`` such as "*100" or
  "max", ``with`` for a range over several fields). The doc's number must be that value as the doc rounds
  it (``shows``). A range ``a-b`` is one number: its value is a list, ``a`` its minimum and ``b`` its
  maximum, so a range is the JSON's full range for the case it names (or the entry's fields say what the
  phrase leaves out); a single number for a list must be every value of it.
- ``not_measured``: numbers the rule below matches that are no measurement (an input size, a target, a
  setting of the pack, a product name, an upstream figure), each with its reason; a phrase here may occur
  more than once.
- ``measured_without_result_file``: measurements no committed result holds (the test suite's own cost on
  the development machine), each with its reason -- the list of what a reader cannot check.

A measured number the registry does not hold fails, and so does an entry whose phrase left its doc.

What counts as a measured number (``measured_numbers``), in prose outside code spans, link targets and URLs:
- a decimal with a fractional part (0.0527, 120.4, 1.46), or
- a number with a unit of measurement after it: ``%``, a ratio's ``x`` / ``×`` (attached when the number
  is an integer: ``2x``), ``s``, ``s/step``, ``minutes``, ``ms``, ``us``, ``µs``, ``GiB``, ``MiB``, ``GB``,
  ``MB``, ``TFLOP/s``, ``frames``, ``tokens``;
and not a version (two dots, ``1.x``, ``0.34+``, or after a software name: ``torch 2.11``, ``CUDA 13.0``,
``SageAttention 2.2``), a date, a clock time, a token joined to letters (``sm_120``, ``H100``, ``fp8``,
``40xx``, a commit hash), a dimension (``1280×720``), or a planted factor written before its number
(``×16``). Bare integers and integer ranges without a unit (``56 heads``, ``50 blocks``, ``10 of 10``,
``blocks 40-49``) are not measured numbers by this rule; the registry still holds many of them (the counts
of moved blocks, the profile table's columns, the TFLOP/s ranges).
"""
import fnmatch
import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
REGISTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs_numbers.json")
CITE = re.compile(r"bench/results/[A-Za-z0-9_./*-]*[A-Za-z0-9_/*]")
DOCS = ("README.md", "docs/MEASURED.md", "docs/USING.md")
#: at least this many registered numbers per doc, so that a registry emptied by mistake cannot pass; USING.md
#: quotes none (it links MEASURED.md)
MIN_NUMBERS = {"README.md": 6, "docs/MEASURED.md": 400, "docs/USING.md": 0}


def _cited():
    out = set()
    for doc in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            out |= {(os.path.basename(doc), m) for m in CITE.findall(f.read())}
    return out


def test_docs_cite_results():
    cited = _cited()
    assert len(cited) > 20  # the docs cite their results; an empty match would make this test pass vacuously
    missing = sorted((doc, p) for doc, p in cited if not glob.glob(os.path.join(ROOT, p)))
    assert not missing, f"cited but not committed: {missing}"


def test_readme_numbers_cite_results():
    """The README's measured summary names its result files itself (not only through docs/)."""
    readme = {p for doc, p in _cited() if doc == "README.md"}
    assert len(readme) >= 3, readme


# ---- what a measured number is ------------------------------------------------------------------------

MINUS = "−"  # U+2212, as the docs write a negative change
_NUM = r"[0-9](?:,?[0-9])*(?:\.[0-9]+)*"
_SIGNED = rf"[+\-{MINUS}]?{_NUM}"
# a number, or a range of two (no space around the dash); the sign only where a word or a space precedes it
TOKEN = re.compile(rf"(?<![\w.,#/\\@$:+\-{MINUS}±]){_SIGNED}(?:[-–]{_NUM})?"
                   rf"|(?:(?<=±)|(?<=×)|(?<= x)|(?<=\(x)){_NUM}(?:[-–]{_NUM})?")
UNITS = r"(?:%|s/step|ms\b|us\b|µs\b|s\b|minutes\b|GiB\b|MiB\b|GB\b|MB\b|TFLOP/s|frames\b|tokens\b)"
RATIO = r"(?:x\b|×)"
SOFTWARE = re.compile(r"(?:torch|CUDA|ComfyUI|Python|sageattention|SageAttention|sage|Triton|comfy-kitchen|"
                      r"comfy-aimdo|PyTorch|Lotus-D v|version|versions) $")


def normalise(text: str) -> str:
    """The doc as the registry's phrases are matched against it: whitespace runs are one space."""
    return re.sub(r"\s+", " ", text)


def _blank(text: str, pattern: str) -> str:
    return re.sub(pattern, lambda m: " " * len(m.group()), text)


def prose(text: str) -> str:
    """``text`` (normalised) with code spans, link targets and URLs blanked (same length, same positions)."""
    text = _blank(text, r"`[^`]*`")
    text = _blank(text, r"\]\([^)]*\)")
    return _blank(text, r"https?://\S+")


def measured_numbers(text: str):
    """(start, end, token) of each measured number in normalised ``text`` (the rule in the module docstring)."""
    p = prose(text)
    out = []
    for m in TOKEN.finditer(p):
        s, e, tok = m.start(), m.end(), m.group()
        after, before = p[e:e + 12], p[max(0, s - 24):s]
        if re.match(r"[A-Za-z_]", after) and not re.match(rf"(?:{UNITS}|{RATIO})", after):
            continue  # joined to letters: sm_89, 40xx, 8.9+PTX is below
        if re.search(r"[x×]$", before) and "." not in tok:
            continue  # a factor written before its number: x16, ×32
        if after.startswith((".x", "+")) or re.match(r"[×x][0-9]", after):
            continue  # a version, a build, a dimension 1280×720
        if before.endswith(("×", "x")) and re.search(r"[0-9][×x]$", before):
            continue  # the second side of a dimension
        body = re.split("[-–]", tok.lstrip(f"+-{MINUS}"))[0]
        if body.count(".") >= 2 or SOFTWARE.search(before) and re.fullmatch(r"[0-9]+(?:\.[0-9]{1,2})?", body):
            continue  # 2.2.0, torch 2.11
        if re.fullmatch(r"[0-9]{4}", body) and after.startswith("-") or re.match(r"-[0-9]{2}-[0-9]{2}", after):
            continue  # a date
        if re.match(r":[0-9]{2}", after) or re.search(r"[0-9]:$", before):
            continue  # a clock time 17:15
        unit = re.match(rf" ?(?:{UNITS})", after)
        ratio = re.match(rf"{RATIO}", after) or ("." in body and re.match(rf" (?:{RATIO})", after))
        if "." in body.replace(",", "") or unit or ratio:
            out.append((s, e, tok))
    return out


# ---- reading a JSON field -----------------------------------------------------------------------------

_STEP = re.compile(r"\.?([^.\[\]]+)|\[([^\]]*)\]")


def _matches(item, cond):
    """Whether dict ``item`` has the fields of ``cond``: "arm=sage,size=169k" (a dotted key reads into the
    item), compared as the JSON's text (str(value)) with ``=`` / ``!=``, as numbers with ``>`` / ``<``."""
    for c in cond.split(","):
        key, op, want = re.match(r"([^!=<>]+)(!=|=|>|<)(.*)", c).groups()
        v = item
        for k in key.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        if op in "<>":
            ok = isinstance(v, (int, float)) and (v > float(want) if op == ">" else v < float(want))
        else:
            ok = (str(v) == want) == (op == "=")
        if not ok:
            return False
    return True


def _select(items, cond):
    """The one element of list ``items`` that matches ``cond``."""
    hit = [i for i in items if isinstance(i, dict) and _matches(i, cond)]
    if len(hit) != 1:
        raise KeyError(f"[{cond}] selects {len(hit)} elements, not one")
    return hit[0]


def resolve(data, path: str):
    """The value at ``path`` in ``data``: ``a.b``, ``[3]``, ``[k=v,...]`` (the one list element with those
    fields), ``["a.b"]`` (a key with dots; with ``*`` or ``|`` in it, every key that glob or one of its
    ``|``-alternatives matches, as a list), ``[*]`` (every element or value: the rest of the path is read in
    each, and the result is a list), ``[?k=v,...]`` (the same over the elements with those fields), ``[1:]``
    (the same over a slice)."""
    steps = [(m.group(1), m.group(2)) for m in _STEP.finditer(path)]
    if "".join(m.group(0) for m in _STEP.finditer(path)) != path:
        raise ValueError(f"bad path {path!r}")

    def walk(v, i):
        if i == len(steps):
            return v
        key, br = steps[i]
        if key is not None:
            return walk(v[key], i + 1)
        if br == "*":
            return [walk(x, i + 1) for x in (v.values() if isinstance(v, dict) else v)]
        if br.startswith("?"):
            hit = [walk(x, i + 1) for x in v if isinstance(x, dict) and _matches(x, br[1:])]
            if not hit:
                raise KeyError(f"[{br}] selects nothing")
            return hit
        if br.startswith('"'):
            key = json.loads(br)
            if "*" in key or "|" in key:  # every key that matches the glob (or one of its |-alternatives)
                globs = key.split("|")
                hit = [walk(x, i + 1) for k, x in v.items() if any(fnmatch.fnmatchcase(k, g) for g in globs)]
                if not hit:
                    raise KeyError(f"[{br}] matches no key")
                return hit
            return walk(v[key], i + 1)
        if re.fullmatch(r"-?[0-9]+", br):
            return walk(v[int(br)], i + 1)
        if re.fullmatch(r"-?[0-9]*:-?[0-9]*", br):  # a slice: each of those elements
            a, b = (int(x) if x else None for x in br.split(":"))
            return [walk(x, i + 1) for x in v[a:b]]
        return walk(_select(v, br), i + 1)

    return walk(data, 0)


def _flat(v):
    if isinstance(v, list):
        return [y for x in v for y in _flat(x)]
    return [v]


OPS = {
    "min": lambda v: min(_flat(v)),
    "max": lambda v: max(_flat(v)),
    "median": lambda v: statistics.median(_flat(v)),
    "sum": lambda v: sum(_flat(v)),
    "len": lambda v: len(v),
    "abs": lambda v: _map(v, abs),
}


def _map(v, fn):
    return [_map(x, fn) for x in v] if isinstance(v, list) else fn(v)


def _arith(v, op):
    n = float(op[1:])
    fn = {"*": lambda x: x * n, "/": lambda x: x / n, "+": lambda x: x + n, "-": lambda x: x - n}[op[0]]
    return _map(v, fn)


def _zip(a, b, fn):
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise ValueError(f"lists of {len(a)} and {len(b)}")
        return [_zip(x, y, fn) for x, y in zip(a, b)]
    if isinstance(a, list):
        return [_zip(x, b, fn) for x in a]
    if isinstance(b, list):
        return [_zip(a, y, fn) for y in b]
    return fn(a, b)


_CACHE: dict = {}


def _load(name, rev=None):
    """A JSON under bench/results/, or (a path with a folder) under the repository root, such as the pack's
    own measured table safe_ops/facts/kernel_table.json; with ``rev``, the file as that commit has it (a
    result file a later commit rewrote, that the doc still quotes)."""
    path = name if "/" in name else f"bench/results/{name}"
    if (path, rev) not in _CACHE:
        if rev:
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout
        else:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
        _CACHE[(path, rev)] = json.loads(text)
    return _CACHE[(path, rev)]


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _extract(v, pattern):
    """The number ``pattern``'s group 1 reads in string ``v`` (or in each string of a list that has it)."""
    if isinstance(v, list):
        hit = [_extract(x, pattern) for x in v if isinstance(x, list) or re.search(pattern, x)]
        if not hit:
            raise ValueError(f"{pattern!r} in none of {len(v)} strings")
        return hit[0] if len(hit) == 1 else hit
    m = re.search(pattern, v)
    if not m:
        raise ValueError(f"{pattern!r} not in {v[:200]!r}")
    return _number(m.group(1))


def _innermost(v, fn):
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        return [_innermost(x, fn) for x in v]
    return fn(v)


def _apply(v, ops):
    """``ops`` in order: min, max, median, sum, len, abs; with ``_each`` (``median_each``), that op on each
    innermost list (a run's blocks, a block's candidates); or arithmetic such as "*100", "/1024", "-1"."""
    for op in ops:
        if op.endswith("_each"):
            v = _innermost(v, OPS[op[:-5]])
        else:
            v = OPS[op](v) if op in OPS else _arith(v, op)
    return v


def _operand(entry, spec):
    spec = {"field": spec} if isinstance(spec, str) else spec
    if "with" in spec or "over" in spec or "minus" in spec:  # an entry of its own
        return value({"json": entry.get("json"), "rev": entry.get("rev"), **spec})
    v = resolve(_load(spec.get("json", entry["json"]), spec.get("rev", entry.get("rev"))), spec["field"])
    v = _extract(v, spec["pattern"]) if spec.get("pattern") else v
    return _apply(v, spec.get("ops", []))


def value(entry):
    """The entry's number. From a log (``log`` under bench/results/, ``pattern`` with one group), or from
    ``json`` (as commit ``rev`` has it, where given): its ``field`` (with ``pattern``: the number the regex
    reads in that string; ``field_ops`` applied to it first), minus ``minus``,
    over ``over`` (each a field of the same JSON, or {json, rev, field, pattern, ops}; lists go element by
    element, a single value against each element of a list), then ``ops`` (``_apply``). With ``with`` (a list
    of more such entries, each worked out on its own), the values of all of them in one list, then ``ops``."""
    if "with" in entry:  # a range over more than one field: each part worked out on its own, then joined
        parts = [{k: x for k, x in entry.items() if k not in ("with", "ops")}]
        parts += [{"json": entry.get("json"), **w} for w in entry["with"]]
        return _apply(_flat([value(part) for part in parts]), entry.get("ops", []))
    if "log" in entry:
        with open(os.path.join(RESULTS, entry["log"]), encoding="utf-8") as f:
            v = _extract(f.read(), entry["pattern"])
    else:
        main = {"field": entry["field"], "pattern": entry.get("pattern"), "ops": entry.get("field_ops", [])}
        v = _operand(entry, main)
    if "minus" in entry:
        v = _zip(v, _operand(entry, entry["minus"]), lambda a, b: a - b)
    if "over" in entry:
        v = _zip(v, _operand(entry, entry["over"]), lambda a, b: a / b)
    return _apply(v, entry.get("ops", []))


# ---- the doc's number against the JSON's --------------------------------------------------------------

def parse_number(tok: str):
    """A doc token as (value, decimals shown): "+5.1" -> (5.1, 1), "−3.2" -> (-3.2, 1), "168,382" -> (168382, 0)."""
    t = tok.replace(",", "").replace(MINUS, "-")
    dec = len(t.split(".")[1]) if "." in t else 0
    return float(t), dec


def shows(tok: str, v) -> bool:
    """Whether the doc's ``tok`` is ``v`` as the doc rounds it (half a unit of its last shown digit, either way
    at a tie); a range token needs a list, its ends the list's minimum and maximum; a single number against a
    list must be every value of it."""
    rng = re.fullmatch(rf"([+\-{MINUS}]?{_NUM})[-–]({_NUM})", tok)
    if rng:
        vals = _flat(v) if isinstance(v, list) else None
        if not vals:
            return False
        return shows(rng.group(1), min(vals)) and shows(rng.group(2), max(vals))
    if isinstance(v, list):  # one number for several values: each of them shows as that number
        vals = _flat(v)
        return bool(vals) and all(shows(tok, x) for x in vals)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    x, dec = parse_number(tok)
    return math.isfinite(v) and abs(v - x) <= 0.5 * 10 ** -dec * (1 + 1e-9) + 1e-12


# ---- the registry -------------------------------------------------------------------------------------

MARK = re.compile(r"\[\[(.+?)\]\]")


def registry():
    with open(REGISTRY, encoding="utf-8") as f:
        return json.load(f)


def locate(text: str, phrase: str):
    """(start, end) in normalised ``text`` of the marked number at every occurrence of ``phrase``."""
    m = MARK.search(phrase)
    if not m or len(MARK.findall(phrase)) != 1:
        raise ValueError(f"phrase needs exactly one [[number]]: {phrase!r}")
    plain = normalise(phrase[:m.start()] + m.group(1) + phrase[m.end():])
    off = len(normalise(phrase[:m.start()]))
    out, i = [], text.find(plain)
    while i >= 0:
        out.append((i + off, i + off + len(m.group(1))))
        i = text.find(plain, i + 1)
    return m.group(1), out


def _doc(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return normalise(f.read())


def _source(e):
    return e.get("log") or f"{e['json']} {e['field']} {e.get('ops', '')}".strip()


@pytest.mark.parametrize("doc", DOCS)
def test_each_registered_number_is_its_jsons(doc):
    """Each entry's phrase is in its doc exactly once, and the marked number there is its JSON's value as the
    doc rounds it."""
    text, entries = _doc(doc), registry()[doc]["numbers"]
    assert len(entries) >= MIN_NUMBERS[doc]
    git = shutil.which("git") is not None and os.path.exists(os.path.join(ROOT, ".git"))
    bad, unread = [], []
    for e in entries:
        tok, spans = locate(text, e["phrase"])
        if len(spans) != 1:
            bad.append(f"{len(spans)} times in {doc} (once wanted): {e['phrase']!r}")
            continue
        if '"rev":' in json.dumps(e) and not git:  # a result as an earlier commit has it needs the history
            unread.append(e["phrase"])
            continue
        try:
            v = value(e)
        except Exception as ex:  # a renamed field: say which entry
            bad.append(f"{e['phrase']!r}: {_source(e)}: {type(ex).__name__}: {ex}")
            continue
        if not shows(tok, v):
            bad.append(f"{e['phrase']!r}: the doc says {tok}, {_source(e)} gives {v!r}")
    assert not bad, "\n".join(bad)
    if unread:
        print(f"not a git checkout: {len(unread)} numbers read from an earlier commit's result not checked: {unread}")


def test_using_quotes_no_measurement():
    """docs/USING.md links MEASURED.md for every measurement: its registry section lists no numbers (a measured
    number written there fails test_every_measured_number_has_an_entry until it moves to MEASURED.md)."""
    assert registry()["docs/USING.md"]["numbers"] == []
    assert registry()["docs/USING.md"].get("measured_without_result_file", []) == []


UNREGISTERED = ("not_measured", "measured_without_result_file")


@pytest.mark.parametrize("doc", DOCS)
def test_every_measured_number_has_an_entry(doc):
    """Every measured number of the doc is a registered number, or is listed with its reason: as no measurement
    (an input size, a target, a setting, a version), or as a measurement no committed result file holds."""
    text, reg = _doc(doc), registry()[doc]
    covered, stale = set(), []
    for e in reg["numbers"] + [x for k in UNREGISTERED for x in reg.get(k, [])]:
        _, spans = locate(text, e["phrase"])
        if not spans:
            stale.append(e["phrase"])
        covered |= set(spans)
    for k in UNREGISTERED:
        for e in reg.get(k, []):
            assert e.get("reason"), f"{k} entry without a reason: {e['phrase']!r}"
    assert not stale, f"phrases no longer in {doc}: {stale}"
    missing = [f"{tok!r} in ...{text[max(0, s - 60):e + 20]}..." for s, e, tok in measured_numbers(text)
               if (s, e) not in covered]
    assert not missing, f"{len(missing)} measured numbers of {doc} with no registry entry:\n" + "\n".join(missing)


# ---- the rule and the comparison themselves ---------------------------------------------------------

def test_the_rule_finds_measured_numbers_and_passes_over_the_rest():
    text = normalise(
        "SafeSage took 120.4 s/step, +5.1 % over 122.1; 1.46× the tokens, 753 frames (207,006 tokens), x1.016, "
        "0.016-0.026 and 1.37-1.56×, 98.6 MiB, 2.5 / 17.1 ms, 53 minutes, 551 TFLOP/s, −3.2 %, 2x, 1.161 x. "
        "comfy-kitchen 0.0173. Not: sageattention 2.2.0, torch 2.11, CUDA 13.0, ComfyUI 0.34+, sage 1.x, 8.9+PTX, sm_120, "
        "H100, "
        "1664×960, ×16 / x32, 2026-12-03 17:15-17:53 UTC, pack 504e661, 56 heads, blocks 40-49, "
        "`--tokens 8192 0.5`, [a link](docs/x_1.5.md), https://example.org/v1.2, SageAttention #388.")
    found = [tok for _, _, tok in measured_numbers(text)]
    assert found == ["120.4", "+5.1", "122.1", "1.46", "753", "207,006", "1.016", "0.016-0.026", "1.37-1.56",
                     "98.6", "2.5", "17.1", "53", "551", "−3.2", "2", "1.161", "0.0173"]


def test_a_number_shows_only_its_value_as_the_doc_rounds_it():
    assert shows("0.0563", 0.056299) and not shows("0.0563", 0.05636)
    assert shows("+5.1", 5.105) and shows("−3.2", -3.2) and not shows("+5.1", -5.1)
    assert shows("168,382", 168382) and not shows("168,382", 168383)
    assert shows("0.0034", 0.00345) and shows("0.0035", 0.00345)  # a tie reads either way
    # a range is the list's minimum and maximum; leaving out a value beyond either end fails
    assert shows("0.016-0.026", [0.01589, 0.02, 0.02595]) and not shows("0.016-0.026", [0.01589, 0.0263, 0.031])
    assert not shows("0.016-0.026", 0.02)  # a range needs the list it spans
    # one number for several values: every one of them
    assert shows("4.42", [4.42, 4.42]) and not shows("0.0563", [0.056299, 0.0571])


def test_value_reads_fields_and_works_them():
    _CACHE[("bench/results/_unit.json", None)] = {
        "runs": [{"arm": "a", "t": [10.0, 2.0, 4.0]}, {"arm": "b", "t": [8.0, 1.0, 3.0]}],
        "m": {"x:3d": 1.5, "y:3d": 2.5, "x:4d": 9.0}, "s": "kernel temporaries 8089 MiB per launch"}
    try:
        e = {"json": "_unit.json"}
        assert value({**e, "field": "runs[arm=a].t[1:]", "ops": ["median"]}) == 3.0
        assert value({**e, "field": "runs[arm=a].t[0]", "over": "runs[arm=b].t[0]", "ops": ["-1", "*100"]}) == 25.0
        assert value({**e, "field": "runs[*].t[1:]", "ops": ["max_each"]}) == [4.0, 3.0]
        assert value({**e, "field": 'm["*:3d"]', "ops": ["max"]}) == 2.5
        assert value({**e, "field": "s", "pattern": r"temporaries ([0-9]+) MiB"}) == 8089
        assert value({**e, "field": "runs[?arm!=a].t[0]", "with": [{"field": "runs[arm=a].t[2]"}]}) == [8.0, 4.0]
        with pytest.raises(KeyError):
            value({**e, "field": "runs[t=1].t"})  # a selector that picks nothing is an error, not a pass
    finally:
        del _CACHE[("bench/results/_unit.json", None)]
