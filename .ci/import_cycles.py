#!/usr/bin/env python3
"""File-level import circles inside each crate of the workspace.

A node is a source file; file A depends on file B when A names an item of B: a `use`
of `crate::…`, `super::…` or `self::…`, or such a path written inline. A path that ends
in an item a module file re-exports (`pub use child::Item`) resolves to the file that
defines it. A module file's own `pub use` of its descendants is its facade, not a
dependency; unit-test modules at the end of a file are not read. Prints every strongly connected component of more than one file, per crate.

`.ci/import-circles.txt` lists the circles still allowed (one a line, its files sorted
and joined by ` <-> `); with no crate named, the check fails on a circle that is not
within a listed one, and on a listed one that is gone (remove its line): the list only
shrinks, and a crate's count goes to zero one circle at a time. `--write` rewrites it.

Usage: .ci/import_cycles.py [--write] [CRATE_DIR ...]   (default: every workspace member
and the root crate; naming crates only prints)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shown(p):
    """`p` relative to the workspace root where it lies under it."""
    try:
        return str(p.resolve().relative_to(ROOT)) or "."
    except ValueError:
        return str(p)
USE_RE = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)
PATH_RE = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def strip_comments(text):
    """Comments, and unit-test modules (`#[cfg(test)] mod …`, which by convention close
    a file): a test's `use super::*` is not a dependency of the code."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    cut = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
    return text[: cut.start()] if cut else text


def expand(tree):
    """`a::{b, c::{d}}` -> ['a::b', 'a::c::d']."""
    tree = tree.replace(" ", "").replace("\n", "")
    if "{" not in tree:
        return [re.sub(r"as[A-Za-z_][A-Za-z0-9_]*$", "", tree) if "::" in tree else tree]
    head, rest = tree.split("{", 1)
    body = rest[: rest.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    if cur:
        parts.append(cur)
    out = []
    for p in parts:
        out += [head + q if q != "self" else head.rstrip(":") for q in expand(p)]
    return out


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = sorted(src.rglob("*.rs"))
        self.mod_of = {}  # module path tuple -> file
        for f in self.files:
            rel = f.relative_to(src).with_suffix("").parts
            if rel in (("lib",), ("main",)):
                mod = ()
            elif rel[-1] == "mod":
                mod = rel[:-1]
            else:
                mod = rel
            # `src/bin/*.rs` and a `main.rs` beside `lib.rs` are crates of their own.
            if rel[0] == "bin" or (rel == ("main",) and (src / "lib.rs").exists()):
                continue
            self.mod_of.setdefault(mod, f)
        self.module = {f: m for m, f in self.mod_of.items()}
        self.text = {f: strip_comments(f.read_text()) for f in self.module}
        self.reexports = {f: self.reexports_of(f) for f in self.module}

    def reexports_of(self, f):
        """Item name -> absolute path it re-exports, for `pub use` lines of `f`."""
        out = {}
        for m in USE_RE.finditer(self.text[f]):
            if not m.group(1):
                continue
            for p in expand(m.group(2)):
                name = p.split("::")[-1]
                out[name] = self.absolute(f, p)
        return out

    def absolute(self, f, path):
        parts = path.split("::")
        mod = list(self.module[f])
        if parts[0] == "crate":
            mod, parts = [], parts[1:]
        elif parts[0] in ("super", "self"):
            while parts and parts[0] in ("super", "self"):
                if parts[0] == "super":
                    mod = mod[:-1]
                parts = parts[1:]
        elif tuple(mod + parts[:1]) in self.mod_of:
            pass  # a child module named without `self::` (2018 paths)
        else:
            return None
        return tuple(mod + parts)

    def resolve(self, path, seen=()):
        """The file defining the item at absolute `path` (deepest module, then through
        re-exports)."""
        if path is None:
            return None
        for k in range(len(path), -1, -1):
            f = self.mod_of.get(path[:k])
            if f is None:
                continue
            rest = path[k:]
            if rest and rest[0] in self.reexports[f] and f not in seen:
                target = self.reexports[f][rest[0]]
                if target and target != path:
                    return self.resolve(target + rest[1:], seen + (f,)) or f
            return f
        return None

    def edges(self):
        out = {f: set() for f in self.module}
        for f in self.module:
            text = self.text[f]
            paths = []
            for m in USE_RE.finditer(text):
                for p in expand(m.group(2)):
                    a = self.absolute(f, p)
                    # A module's re-export of its own descendants is its facade.
                    if m.group(1) and a and a[: len(self.module[f])] == self.module[f]:
                        continue
                    paths.append(a)
            no_use = USE_RE.sub("", text)
            paths += [self.absolute(f, p) for p in PATH_RE.findall(no_use)]
            for a in paths:
                g = self.resolve(a)
                if g and g != f:
                    out[f].add(g)
        return out


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


ALLOWED = ROOT / ".ci" / "import-circles.txt"


def main():
    args = [a for a in sys.argv[1:] if a != "--write"]
    dirs = [Path(d) for d in args] or [ROOT] + [
        p.parent for p in sorted(ROOT.glob("*/Cargo.toml"))
    ]
    found = []
    for d in dirs:
        src = (d / "src").resolve()
        if src.is_dir():
            found += [[shown(f) for f in comp] for comp in sccs(Crate(src).edges())]
    for comp in found:
        print(" <-> ".join(comp))
    print(f"{len(found)} import circle(s)")
    if args:
        return 0
    if "--write" in sys.argv[1:]:
        ALLOWED.write_text(
            "# Import circles still allowed; this list may only shrink "
            "(.ci/import_cycles.py).\n" + "".join(" <-> ".join(c) + "\n" for c in found)
        )
        return 0
    allowed = [
        set(l.split(" <-> ")) for l in ALLOWED.read_text().splitlines()
        if l.strip() and not l.startswith("#")
    ]
    problems = [
        "new circle: " + " <-> ".join(c) for c in found
        if not any(set(c) <= a for a in allowed)
    ]
    problems += [
        "gone (remove its line): " + " <-> ".join(sorted(a)) for a in allowed
        if not any(set(c) <= a for c in found)
    ]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
