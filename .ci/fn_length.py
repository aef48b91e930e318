#!/usr/bin/env python3
"""Functions longer than 70 lines in the product's code (every crate's `src/`, unit-test
modules and `src/bin` excluded), from the `fn` line to its closing brace.

`.ci/long-functions.txt` lists the exceptions, one `path::name lines` a line. The check
fails when a function not on the list is over the limit, when a listed one grew, and
when a listed one shrank or went away without its line being lowered or removed — so
the list only shrinks. `--write` rewrites the list from the tree (for a change that
shortens functions; review the diff: a line may only go down or away).

Usage: .ci/fn_length.py [--write]
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 70
LIST = ROOT / ".ci" / "long-functions.txt"
FN_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:default\s+)?(?:const\s+)?(?:async\s+)?"
    r"(?:unsafe\s+)?(?:extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)"
)


def code_only(line, in_block):
    """`line` without string literals and comments; whether a block comment is open."""
    out, i = [], 0
    while i < len(line):
        if in_block:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_block = end + 2, False
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            in_block, i = True, i + 2
            continue
        if c == '"':
            j = i + 1
            while j < len(line) and line[j] != '"':
                j += 2 if line[j] == "\\" else 1
            i = j + 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out), in_block


def functions(path):
    """(name, lines) of every function with a body in `path` before its test module."""
    lines = path.read_text().splitlines()
    cut = next(
        (k for k, l in enumerate(lines) if re.match(r"\s*#\[cfg\(test\)\]", l)
         and k + 1 < len(lines) and re.match(r"\s*(pub\s+)?mod\s", lines[k + 1])),
        len(lines),
    )
    code, in_block = [], False
    for l in lines[:cut]:
        c, in_block = code_only(l, in_block)
        code.append(c)
    out = []
    for k, l in enumerate(code):
        m = FN_RE.match(l)
        if not m:
            continue
        depth, opened = 0, False
        for j in range(k, len(code)):
            text = code[j]
            if not opened and ";" in text and "{" not in text:
                break  # a declaration without a body (trait method, extern)
            for ch in text:
                if ch == "{":
                    depth += 1
                    opened = True
                elif ch == "}":
                    depth -= 1
            if opened and depth == 0:
                out.append((m.group(1), j - k + 1))
                break
    return out


def sources():
    for cargo in [ROOT / "Cargo.toml"] + sorted(ROOT.glob("*/Cargo.toml")):
        src = cargo.parent / "src"
        for f in sorted(src.rglob("*.rs")):
            rel = f.relative_to(ROOT)
            if "bin" in f.relative_to(src).parts[:1]:
                continue
            yield rel, f


def measure():
    found = {}
    for rel, f in sources():
        for name, n in functions(f):
            key = f"{rel}::{name}"
            # Two functions of one name in a file (impls of a trait): the longest counts.
            if n > LIMIT and n > found.get(key, 0):
                found[key] = n
    return found


def main():
    found = measure()
    if "--write" in sys.argv[1:]:
        LIST.write_text(
            "# Functions over 70 lines, allowed for now. This list may only shrink:\n"
            "# .ci/fn_length.py fails when a function grows or a new one passes 70.\n"
            + "".join(f"{k} {n}\n" for k, n in sorted(found.items()))
        )
        print(f"wrote {len(found)} exceptions to {LIST.relative_to(ROOT)}")
        return 0
    allowed = {}
    for line in LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, n = line.rsplit(" ", 1)
            allowed[key] = int(n)
    problems = []
    for key, n in sorted(found.items()):
        if key not in allowed:
            problems.append(f"{key}: {n} lines (limit {LIMIT}); split it")
        elif n > allowed[key]:
            problems.append(f"{key}: grew to {n} lines (listed at {allowed[key]}); split it")
        elif n < allowed[key]:
            problems.append(f"{key}: now {n} lines; lower its line in {LIST.name} to {n}")
    for key, n in sorted(allowed.items()):
        if key not in found:
            problems.append(f"{key}: no longer over {LIMIT} lines; remove it from {LIST.name}")
    for p in problems:
        print(p)
    print(f"{len(found)} functions over {LIMIT} lines, {len(allowed)} listed, "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
