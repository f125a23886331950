#!/usr/bin/env python3
"""Replaces what lies between `<!-- NAME:start -->` and `<!-- NAME:end -->`
in a Markdown file with the contents of another file (a generated table),
so that a benchmark target can write its numbers into the docs.

usage: scripts/splice-doc.py DOC NAME TABLE
"""
import sys


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    doc, name, table = sys.argv[1:]
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(doc, encoding="utf-8").read()
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        print(f"splice-doc: {doc} needs one {start} ... {end} pair", file=sys.stderr)
        return 1
    body = open(table, encoding="utf-8").read().strip("\n")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    with open(doc + ".tmp", "w", encoding="utf-8") as f:
        f.write(f"{head}{start}\n{body}\n{end}{tail}")
    import os

    os.replace(doc + ".tmp", doc)
    print(f"splice-doc: wrote {name} into {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
