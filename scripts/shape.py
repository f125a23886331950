#!/usr/bin/env python3
"""The shape of the shells (issue 22's "done when"), checked on every CI run.

In the crates that hold the shells (gateway/, lease/, lease-core/, edge/):
- no non-test function is over 120 lines (from its `fn` line to its closing
  brace);
- no source file is over 1,000 non-test lines (every line outside
  `#[cfg(test)]` items and test-only module files, comments included);
and in the whole workspace there is no `#[path]` include (test support lives
in the `tidegate-testkit` crate).

    python3 scripts/shape.py              # check; exit 1 naming each breach
    python3 scripts/shape.py --top 10     # also list the longest functions and files
    python3 scripts/shape.py --self-test  # the parser on known snippets

The parser is a small Rust tokenizer: comments, strings (raw and byte),
char literals and lifetimes are told apart, so braces are matched only
where they are code.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_CRATES = ("gateway", "lease", "lease-core", "edge")
MAX_FN_LINES = 120
MAX_FILE_LINES = 1000
SKIP_DIRS = {"target", ".git", "node_modules", "fuzz/target"}

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Tok:
    text: str
    line: int


def tokenize(src: str) -> list[Tok]:
    """Identifiers and the punctuation that structures items, with lines.

    Comments, string and char literals are skipped; lifetimes are skipped.
    """
    toks: list[Tok] = []
    i, line, n = 0, 1, len(src)
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += src[i] == "\n"
                    i += 1
        elif (m := re.compile(r'b?r(#*)"').match(src, i)) and (
            i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")
        ):
            end = '"' + m.group(1)
            j = src.find(end, m.end())
            j = n if j < 0 else j + len(end)
            line += src.count("\n", i, j)
            i = j
        elif c == '"' or (c == "b" and src.startswith('b"', i)):
            i += 2 if c == "b" else 1
            while i < n and src[i] != '"':
                if src[i] == "\\":
                    i += 1
                line += src[i] == "\n"
                i += 1
            i += 1
        elif c == "'" or (c == "b" and src.startswith("b'", i)):
            start = i + (2 if c == "b" else 1)
            # A char literal: 'x', '\n', '\'', '\u{1F600}'; otherwise a lifetime.
            m = re.compile(r"(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'").match(
                src, start
            )
            if m:
                i = m.end()
            elif c == "b":
                toks.append(Tok("b", line))
                i += 1
            else:
                m = IDENT.match(src, start)
                i = m.end() if m else start
        elif m := IDENT.match(src, i):
            toks.append(Tok(m.group(0), line))
            i = m.end()
        else:
            if c in "{}()[];#!=":
                toks.append(Tok(c, line))
            i += 1
    return toks


def matching(toks: list[Tok], i: int) -> int:
    """Index of the bracket that closes the one at `i`."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = [pairs[toks[i].text]]
    j = i + 1
    while j < len(toks) and stack:
        t = toks[j].text
        if t in pairs:
            stack.append(pairs[t])
        elif stack and t == stack[-1]:
            stack.pop()
        j += 1
    return j - 1


def item_end(toks: list[Tok], i: int) -> int:
    """From an item's first token, the index of its last: the `;` or the
    `}` that closes its body, whichever comes first at bracket depth 0."""
    j = i
    while j < len(toks):
        t = toks[j].text
        if t in "([":
            j = matching(toks, j) + 1
            continue
        if t == ";":
            return j
        if t == "{":
            return matching(toks, j)
        j += 1
    return len(toks) - 1


def attribute_end(toks: list[Tok], i: int) -> int:
    """`toks[i]` is `#`; the index of the attribute's closing `]`."""
    j = i + 1
    if j < len(toks) and toks[j].text == "!":
        j += 1
    return matching(toks, j) if j < len(toks) and toks[j].text == "[" else i


def is_test_cfg(toks: list[Tok], i: int, end: int) -> bool:
    words = [t.text for t in toks[i:end]]
    if len(words) < 4 or words[2] != "cfg":
        return False
    body = words[3:]
    return "test" in body and "not" not in body


@dataclass
class FileShape:
    path: Path
    lines: int
    test_lines: int = 0
    test_modules: list[str] = field(default_factory=list)
    functions: list[tuple[str, int, int]] = field(default_factory=list)
    path_includes: int = 0

    @property
    def non_test_lines(self) -> int:
        return self.lines - self.test_lines


def shape_of(src: str, path: Path = Path("<snippet>")) -> FileShape:
    toks = tokenize(src)
    shape = FileShape(path, src.count("\n") + (0 if src.endswith("\n") else 1))
    test_spans: list[tuple[int, int]] = []
    i = 0
    while i < len(toks):
        t = toks[i].text
        if t == "#":
            end = attribute_end(toks, i)
            if end > i + 2 and toks[i + 1].text == "[" and toks[i + 2].text == "path":
                shape.path_includes += 1
            if end > i and is_test_cfg(toks, i, end):
                first = i
                j = end + 1
                while j < len(toks) and toks[j].text == "#":
                    j = attribute_end(toks, j) + 1
                k = j
                while k < len(toks) and toks[k].text in ("pub", "crate", "(", ")", "super"):
                    k += 1
                last = item_end(toks, j)
                if k + 2 < len(toks) and toks[k].text == "mod" and toks[k + 2].text == ";":
                    shape.test_modules.append(toks[k + 1].text)
                test_spans.append((toks[first].line, toks[last].line))
                i = last + 1
                continue
            i = end + 1
            continue
        if t == "fn" and i + 1 < len(toks) and IDENT.fullmatch(toks[i + 1].text):
            end = item_end(toks, i)
            if toks[end].text == "}":
                length = toks[end].line - toks[i].line + 1
                shape.functions.append((toks[i + 1].text, toks[i].line, length))
            # Functions nested in this one are counted too.
            i += 2
            continue
        i += 1
    covered: set[int] = set()
    for a, b in test_spans:
        covered.update(range(a, b + 1))
    shape.test_lines = len(covered)
    return shape


def child_module_files(path: Path, name: str) -> list[Path]:
    base = path.parent if path.name in ("mod.rs", "lib.rs", "main.rs") else path.with_suffix("")
    return [base / f"{name}.rs", base / name / "mod.rs"]


def rust_files(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*.rs")
        if not any(part in SKIP_DIRS for part in p.relative_to(ROOT).parts)
    )


def test_only_files(shapes: dict[Path, FileShape]) -> set[Path]:
    """Files included only as `#[cfg(test)] mod name;`, and every file below them."""
    tests: set[Path] = set()
    for path, shape in shapes.items():
        for name in shape.test_modules:
            for f in child_module_files(path, name):
                if f in shapes:
                    tests.add(f)
                    below = f.parent if f.name == "mod.rs" else f.with_suffix("")
                    tests.update(p for p in shapes if below in p.parents)
    return tests


def check(top: int) -> int:
    breaches: list[str] = []
    all_files = rust_files(ROOT)
    includes = 0
    for path in all_files:
        n = shape_of(path.read_text(encoding="utf-8"), path).path_includes
        if n:
            includes += n
            breaches.append(f"{path.relative_to(ROOT)}: {n} #[path] include(s)")
    functions: list[tuple[int, str]] = []
    files: list[tuple[int, str]] = []
    for crate in SHELL_CRATES:
        src = ROOT / crate / "src"
        shapes = {p: shape_of(p.read_text(encoding="utf-8"), p) for p in rust_files(src)}
        tests = test_only_files(shapes)
        for path, shape in shapes.items():
            if path in tests:
                continue
            rel = str(path.relative_to(ROOT))
            files.append((shape.non_test_lines, rel))
            if shape.non_test_lines > MAX_FILE_LINES:
                breaches.append(
                    f"{rel}: {shape.non_test_lines} non-test lines (at most {MAX_FILE_LINES})"
                )
            for name, line, length in shape.functions:
                functions.append((length, f"{rel}:{line} {name}"))
                if length > MAX_FN_LINES:
                    breaches.append(
                        f"{rel}:{line}: fn {name} is {length} lines (at most {MAX_FN_LINES})"
                    )
    if top:
        print(f"longest non-test functions in {', '.join(SHELL_CRATES)}:")
        for length, where in sorted(functions, reverse=True)[:top]:
            print(f"  {length:5}  {where}")
        print("largest files by non-test lines:")
        for length, where in sorted(files, reverse=True)[:top]:
            print(f"  {length:5}  {where}")
    longest_fn = max(functions)[0] if functions else 0
    largest = max(files)[0] if files else 0
    print(
        f"shape: longest non-test function {longest_fn} lines (max {MAX_FN_LINES}), "
        f"largest file {largest} non-test lines (max {MAX_FILE_LINES}), "
        f"{includes} #[path] includes in {len(all_files)} files"
    )
    for b in breaches:
        print(f"breach: {b}", file=sys.stderr)
    return 1 if breaches else 0


SNIPPET = r'''//! A module.
use std::fmt; // a comment with { an unmatched brace
/// Doc with a "quote and a { brace.
pub fn short<'a>(s: &'a str) -> char {
    let _c = '{';
    let _q = '\'';
    let _u = '\u{7B}';
    let _raw = r#"}"# ;
    let _b = b'}';
    /* nested /* { */ still a comment } */
    let _s = "}\"{";
    s.chars().next().unwrap_or('}')
}

trait T {
    fn declared(&self);
}

#[cfg(test)]
mod inline {
    fn in_a_test() {
    }
}

#[cfg(test)]
mod tests;

#[cfg(not(test))]
fn only_outside_tests() {}

fn long() {
    let v = [1, 2];
    let _ = v;
}
'''


def self_test() -> int:
    s = shape_of(SNIPPET)
    names = {name: (line, length) for name, line, length in s.functions}
    checks = [
        (names.get("short"), (4, 10)),
        ("declared" in names, False),
        ("in_a_test" in names, False),
        (names.get("long"), (31, 4)),
        (names.get("only_outside_tests"), (29, 1)),
        (s.test_modules, ["tests"]),
        # lines 19-23 (inline) and 25-26 (mod tests;)
        (s.test_lines, 7),
        (s.lines, 34),
        (shape_of('#[path = "x.rs"]\nmod x;\n').path_includes, 1),
        (
            child_module_files(Path("a/src/hub/mod.rs"), "tests"),
            [Path("a/src/hub/tests.rs"), Path("a/src/hub/tests/mod.rs")],
        ),
        (
            child_module_files(Path("a/src/leasing.rs"), "tests"),
            [Path("a/src/leasing/tests.rs"), Path("a/src/leasing/tests/mod.rs")],
        ),
    ]
    failed = [(got, want) for got, want in checks if got != want]
    for got, want in failed:
        print(f"self-test: got {got!r}, want {want!r}", file=sys.stderr)
    print(f"shape self-test: {len(checks) - len(failed)} of {len(checks)} checks pass")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=0, help="list the N longest functions and files")
    ap.add_argument("--self-test", action="store_true", help="check the parser on snippets")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    return check(args.top)


if __name__ == "__main__":
    sys.exit(main())
