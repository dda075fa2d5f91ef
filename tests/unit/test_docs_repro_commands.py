"""docs/REPRODUCTION.md's commands run as written: each Python command in its code blocks (and in its
inline code spans) is run with ``--help`` from the repository root, as the file writes it (module or
script, subcommand, options), and every long option it uses must be one that ``--help`` lists; every
repository path it names must exist. Nothing is skipped silently: each other shell command of a block
must be one of NON_PYTHON, else the test fails naming it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "REPRODUCTION.md")

#: the shell commands of the blocks that are not Python, each with why it needs no --help run
NON_PYTHON = {
    "source": "bench/device_setup.sh (its path is checked to exist)",
    "ss_base": "a function of bench/device_setup.sh",
    "ss_kitchen": "a function of bench/device_setup.sh",
    "ss_sage": "a function of bench/device_setup.sh",
    "export": "sets PYTHONPATH",
    "mkdir": "coreutils",
    "cp": "coreutils",
    "shift": "inside the R() helper",
    "R": "the block's own helper around python3 -m bench.repro all (its body is checked)",
}
PYTHONS = ("python", "python3")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|", "(", ")", "{", "}", "()", "&"}
_REDIRECTS = {">", ">>", "<", "2>", "2>>", "&>"}


def code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            start, body = i + 2, []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body)))
        i += 1
    return blocks


def inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the inline code spans outside the blocks that start a Python command."""
    outside = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    spans = []
    for m in re.finditer(r"`([^`]+)`", outside):
        words = m.group(1).split()
        while words and _ASSIGN.match(words[0]):
            words.pop(0)
        if words and words[0] in PYTHONS:
            spans.append((outside.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return spans


def simple_commands(block: str) -> list[list[str]]:
    """The block's simple shell commands as word lists: continuation lines joined, comments dropped,
    split at && || ; | ( ) { }, redirections and leading VAR=value assignments removed."""
    lex = shlex.shlex(block.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    commands, cur, tokens = [], [], list(lex)
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t in _SEPARATORS or t == "\n":
            commands.append(cur)
            cur = []
        elif t in _REDIRECTS:
            i += 1                    # and its target
        else:
            cur.append(t)
        i += 1
    commands.append(cur)
    out = []
    for words in commands:
        while words and _ASSIGN.match(words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _lines_split(block: str, first: int = 1) -> list[tuple[int, str]]:
    """(line number, logical line): continuation lines joined (shlex does not see newlines as
    command separators, so the block is split into its logical lines first)."""
    out, cur, start = [], [], first
    for n, ln in enumerate(block.splitlines(), first):
        if not cur:
            start = n
        if ln.endswith("\\"):
            cur.append(ln[:-1])
            continue
        cur.append(ln)
        text = " ".join(cur)
        cur = []
        if text.strip():
            out.append((start, text))
    if cur and " ".join(cur).strip():
        out.append((start, " ".join(cur)))
    return out


def doc_commands() -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """(python commands, other commands), each as (where, words)."""
    with open(DOC) as f:
        text = f.read()
    py, other = [], []
    for start, block in code_blocks(text):
        for n, line in _lines_split(block, start):
            for words in simple_commands(line):
                where = "docs/REPRODUCTION.md block line %d, command %r" % (n, " ".join(words)[:80])
                (py if words[0] in PYTHONS else other).append((where, words))
    for line, span in inline_spans(text):
        for words in simple_commands(span):
            py.append(("docs/REPRODUCTION.md line %d, `%s`" % (line, span[:80]), words))
    return py, other


def help_argv(words: list[str]) -> list[str]:
    """The command as written up to its first option (module or script, subcommand, positionals),
    then --help (a mode that is itself an option, like --table, is kept)."""
    assert words[0] in PYTHONS, words
    rest = words[1:]
    if rest[:1] == ["-m"]:
        head, rest = ["-m", rest[1]], rest[2:]
    else:
        head, rest = [rest[0]], rest[1:]
    if rest and rest[0] == "--table":    # bench.repro's option-like mode
        return head + ["--table", "--help"]
    positional = []
    for w in rest:
        if w.startswith("-"):
            break
        positional.append(w)
    return head + positional[:1] + ["--help"]


def long_options(words: list[str]) -> list[str]:
    return sorted({w.split("=", 1)[0] for w in words[1:] if w.startswith("--") and len(w) > 2})


def repo_paths(words: list[str]) -> list[str]:
    """Words naming a file of this repository's bench/, docs/ or tools/ (committed results, scripts)."""
    return [w for w in words if re.match(r"^(bench|docs|tools)/[\w./-]+$", w) and "*" not in w]


PY, OTHER = doc_commands()


def test_the_doc_has_python_commands_to_check():
    # the parser found the blocks: 2nd/3rd/commands/CPU smoke blocks hold at least 10 Python commands
    assert len([w for w, _ in PY if "block" in w]) >= 10, PY
    assert any(words[1:3] == ["-m", "bench.repro"] for _, words in PY)
    assert any(words[1:3] == ["-m", "bench.common.synth_h3"] for _, words in PY)


def test_every_other_shell_command_is_a_known_one():
    unknown = ["%s: %r is neither python nor one of NON_PYTHON" % (where, words[0])
               for where, words in OTHER if words[0] not in NON_PYTHON]
    assert not unknown, "\n".join(unknown)
    sources = [words for _, words in OTHER if words[0] == "source"]
    assert sources and all(os.path.isfile(os.path.join(ROOT, w[1])) for w in sources), sources


_HELP_CACHE: dict = {}


def _help(argv: list[str]) -> subprocess.CompletedProcess:
    key = tuple(argv)
    if key not in _HELP_CACHE:
        _HELP_CACHE[key] = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                                          timeout=120, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return _HELP_CACHE[key]


def _id(where: str, words: list[str]) -> str:
    line = re.search(r"line (\d+)", where).group(1)
    return "L%s:%s" % (line, " ".join(help_argv(words)[:-1]))


@pytest.mark.parametrize("where,words", PY, ids=[_id(where, w) for where, w in PY])
def test_doc_command_help_runs_and_lists_its_options(where, words):
    argv = help_argv(words)
    r = _help(argv)
    assert r.returncode == 0, "%s\n`python %s` exited %d:\n%s%s" % (where, " ".join(argv), r.returncode,
                                                                   r.stdout[-2000:], r.stderr[-2000:])
    assert "usage:" in r.stdout.lower(), (where, r.stdout[:500])
    missing = [o for o in long_options(words) if o not in r.stdout and o != "--help"]
    assert not missing, "%s: %s not in `python %s`:\n%s" % (where, missing, " ".join(argv), r.stdout)
    absent = [p for p in repo_paths(words) if not os.path.exists(os.path.join(ROOT, p))]
    assert not absent, "%s names %s, which do not exist" % (where, absent)


def test_the_parser_on_a_block_like_the_docs():
    block = ("source bench/device_setup.sh && ss_base && ss_sage sm89\n"
             "PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.common.synth_h3 /tmp/h.st --blocks 8 > $OUT/s.json\n"
             "R() { out=$1; shift 1; python3 -m bench.repro all --comfy $C \\\n    --plan \"$@\"; }  # note\n"
             "python3 bench/old.py all --x 1\n")
    lines = _lines_split(block, 10)
    assert [n for n, _ in lines] == [10, 11, 12, 14]
    cmds = [w for _, ln in lines for w in simple_commands(ln)]
    assert [c[0] for c in cmds] == ["source", "ss_base", "ss_sage", "python3", "R", "shift", "python3",
                                    "python3"], cmds
    assert help_argv(cmds[3]) == ["-m", "bench.common.synth_h3", "/tmp/h.st", "--help"]
    assert help_argv(cmds[6]) == ["-m", "bench.repro", "all", "--help"]
    assert long_options(cmds[6]) == ["--comfy", "--plan"]
    assert help_argv(cmds[7]) == ["bench/old.py", "all", "--help"]
    assert help_argv(["python", "-m", "bench.repro", "--table", "bench/results/x.json"]) == \
        ["-m", "bench.repro", "--table", "--help"]
