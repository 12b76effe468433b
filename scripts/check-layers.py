#!/usr/bin/env python3
"""check-layers.py: sluice's modules depend one way only (DESIGN.md, section 6b).

    python3 scripts/check-layers.py [SRC_DIR]     # default: src
    python3 scripts/check-layers.py --self-test

Reads every .rs file under SRC_DIR, works out which files of the crate each file names, and
reports two kinds of problem:

  1. an import against the layering: a file of one top-level module names a file of another
     top-level module that is not in a strictly lower layer (two modules of one layer never
     name each other);
  2. a circle of files: files that name each other, directly or through others (a strongly
     connected component of more than one file), inside one module or across modules.

lib.rs and main.rs may name anything. A top-level module missing from the layering is
checked for circles only and gets a "warning: unlisted" line, which does not fail the check.
The last line is always "N imports against the layering, M circles of files (K files read)";
the exit status is 1 when N or M is above 0, 2 when SRC_DIR cannot be read, 0 otherwise.

What counts as naming a file:
  * `use` trees, however deeply grouped: `use crate::a::{b, c::{d, e as f}, self, *};`, also
    `pub use`, `pub(crate) use` and `use` inside function bodies;
  * paths in code and types: `crate::a::b::C`, `$crate::a::B` in macros, `super::x`,
    `super::super::x`, `self::x`;
  * paths through a name a `use` or `mod` brought in: after `use crate::auth;`, the code
    `auth::jwks::KeySet` names auth/jwks.rs; after `mod validate;` (or `use super::*;` in a
    sibling), `validate::x` names validate.rs; in main.rs the library's own name
    (`sluice::cli`) stands for the crate.
Comments (line, block nested or not, doc), string, byte-string, raw-string and char literals
are dropped before anything is read, and so is every item under `#[cfg(test)]` (its braces
matched, so code after a test module still counts): tests name what they test. `mod x { .. }`
written inline is followed, so `self::`/`super::` inside it mean what rustc says they mean.
A path is resolved to the deepest module that exists (a file, or a module written inline in
a file), and so to a file; `foo.rs` beside a `foo/` directory (Rust 2018) is module `foo`.
Not counted: a file naming itself, a file naming one of its own submodules (a mod.rs or
foo.rs that declares and re-exports its children is its module's front, not a tie; the
other way, a child naming its parent, does count), and `pub(in crate::x)` visibility.

The layering (lowest first), from DESIGN.md 6b:
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

LAYERS = [
    ["clock", "config"],
    ["metrics"],
    ["auth", "routing", "tls", "upstream"],
    ["key"],
    ["limiter"],
    ["response"],
    ["gateway"],
    ["proxy", "rls", "admin"],
    ["server"],
    ["cli"],
]
RANK = {name: n for n, layer in enumerate(LAYERS, start=1) for name in layer}
__doc__ += "".join(f"  {n}. {', '.join(layer)}\n" for n, layer in enumerate(LAYERS, start=1))

ROOTS = ("lib.rs", "main.rs")  # crate roots directly under SRC_DIR: they may name anything

# ---------------------------------------------------------------------------------------
# Reading Rust: a small lexer that keeps identifiers and punctuation and nothing else.

RAW_STRING = re.compile(r'(?:br|cr|r)(#*)"')


def is_ident_start(c: str) -> bool:
    return c == "_" or c.isalpha()


def is_ident_char(c: str) -> bool:
    return c == "_" or c.isalnum()


def lex(text: str) -> list[str]:
    """The tokens of a Rust source: identifiers (`r#x` as `x`, `$crate` as `crate`), `::`
    and single punctuation characters. Comments and lifetimes are dropped; each literal
    (string, raw string, byte string, char, number) becomes one placeholder token."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c in "brc" and RAW_STRING.match(text, i):
            m = RAW_STRING.match(text, i)
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            i = n if j < 0 else j + len(close)
            out.append('"str"')
        elif c in "bc" and text.startswith('"', i + 1) or c == '"':
            j = i + 2 if c != '"' else i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            out.append('"str"')
        elif c == "b" and text.startswith("'", i + 1) or c == "'":
            q = i + 1 if c == "b" else i  # the opening quote
            if text.startswith("\\", q + 1):  # '\n', '\'', '\u{..}'
                j = text.find("'", q + 3)
                i = n if j < 0 else j + 1
                out.append("'c'")
            elif q + 2 < n and text[q + 2] == "'":  # 'x'
                i = q + 3
                out.append("'c'")
            else:  # a lifetime or a label: 'a, 'static, 'outer:
                i = q + 1
                while i < n and is_ident_char(text[i]):
                    i += 1
        elif c == "r" and text.startswith("#", i + 1) and i + 2 < n and is_ident_start(text[i + 2]):
            j = i + 2
            while j < n and is_ident_char(text[j]):
                j += 1
            out.append(text[i + 2:j])
            i = j
        elif is_ident_start(c):
            j = i + 1
            while j < n and is_ident_char(text[j]):
                j += 1
            out.append(text[i:j])
            i = j
        elif c.isdigit():
            j = i + 1
            while j < n and is_ident_char(text[j]):
                j += 1
            out.append("0")
            i = j
        elif text.startswith("::", i):
            out.append("::")
            i += 2
        elif c == "$" and text.startswith("crate", i + 1) and not (
                i + 6 < n and is_ident_char(text[i + 6])):
            out.append("crate")
            i += 6
        else:
            out.append(c)
            i += 1
    return out


def is_ident(t: str) -> bool:
    return bool(t) and is_ident_start(t[0])


CLOSER = {"(": ")", "[": "]", "{": "}"}


def matching(tokens: list[str], j: int, end: int) -> int:
    """The index of the bracket that closes the one at tokens[j] (end if it is never closed)."""
    opener, closer, depth = tokens[j], CLOSER[tokens[j]], 0
    for k in range(j, end):
        if tokens[k] == opener:
            depth += 1
        elif tokens[k] == closer:
            depth -= 1
            if depth == 0:
                return k
    return end


def item_end(tokens: list[str], k: int, end: int) -> int:
    """Where the item starting at tokens[k] ends: after its `;` or its closing `}`."""
    depth = 0
    while k < end:
        t = tokens[k]
        if t in "([{":
            depth += 1
        elif t in ")]}":
            depth -= 1
            if depth < 0:
                return k
            if depth == 0 and t == "}":
                return k + 1
        elif t == ";" and depth == 0:
            return k + 1
        k += 1
    return end


class UseTreeError(Exception):
    pass


def use_tree(tokens: list[str], i: int, prefix: list[str], leaves: list) -> int:
    """Reads one use tree at tokens[i]; appends (segments, alias, is_glob) for each leaf."""
    segs = list(prefix)
    if tokens[i] == "::":
        if not segs:
            segs = ["::"]  # `use ::name`: an extern crate
        i += 1
    while True:
        t = tokens[i]
        if t == "{":
            i += 1
            while tokens[i] != "}":
                i = use_tree(tokens, i, segs, leaves)
                if tokens[i] == ",":
                    i += 1
                elif tokens[i] != "}":
                    raise UseTreeError(tokens[i])
            return i + 1
        if t == "*":
            leaves.append((segs, None, True))
            return i + 1
        if not is_ident(t):
            raise UseTreeError(t)
        segs = segs + [t]
        i += 1
        if tokens[i] == "::":
            i += 1
            continue
        alias = None
        if tokens[i] == "as":
            alias = tokens[i + 1]
            i += 2
        leaves.append((segs, alias, False))
        return i


# ---------------------------------------------------------------------------------------
# Reading a tree of files.

def module_of(rel: str) -> tuple[str, ...]:
    """src-relative file -> module path: foo/mod.rs and foo.rs -> (foo,); lib.rs -> ()."""
    parts = rel[:-3].replace(os.sep, "/").split("/")
    if parts[-1] == "mod" or (len(parts) == 1 and parts[0] in ("lib", "main")):
        parts = parts[:-1]
    return tuple(parts)


def package_name(src: str) -> str | None:
    """The package's name from the Cargo.toml beside SRC_DIR, as code spells it."""
    try:
        text = open(os.path.join(os.path.dirname(os.path.abspath(src)), "Cargo.toml"),
                    encoding="utf-8").read()
    except OSError:
        return None
    section = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[package]":
            m = re.match(r'name\s*=\s*"([^"]+)"', line)
            if m:
                return m.group(1).replace("-", "_")
    return None


class Tree:
    """Every file under SRC_DIR, what each declares, imports and names."""

    def __init__(self, src: str, crate_name: str | None):
        self.src = src
        self.crate_name = crate_name
        self.files: list[str] = []                         # src-relative paths, sorted
        self.modules: dict[tuple[str, ...], str] = {}      # module path -> file (inline too)
        self.names: dict[tuple, dict[str, tuple]] = {}     # scope -> name -> module path
        self.globs: dict[tuple, list[tuple]] = {}          # scope -> glob-imported modules
        self.uses: list[tuple] = []                        # (file, scope, segs, alias, glob)
        self.paths: list[tuple] = []                       # (file, scope, segs)
        self.test_only: set[tuple[str, ...]] = set()       # `#[cfg(test)] mod x;`
        self.notes: list[str] = []

    def scope_of(self, rel: str, mp: tuple[str, ...]) -> tuple:
        # main.rs is the root of its own crate (the binary), apart from the library's root
        return ("bin" if rel == "main.rs" else "lib", mp)

    def read(self) -> None:
        for root, dirs, names in os.walk(self.src):
            dirs.sort()
            for name in sorted(names):
                if name.endswith(".rs"):
                    self.files.append(os.path.relpath(os.path.join(root, name), self.src))
        self.files.sort()
        for rel in self.files:
            mp = module_of(rel)
            if rel == "main.rs" and "lib.rs" in self.files:
                continue
            if mp in self.modules:
                self.notes.append(f"warning: {self.show(rel)} and {self.show(self.modules[mp])}"
                                  f" are both module {'::'.join(mp) or 'crate'}")
                continue
            self.modules[mp] = rel
        for rel in self.files:
            try:
                with open(os.path.join(self.src, rel), encoding="utf-8", errors="replace") as f:
                    tokens = lex(f.read())
            except OSError as e:
                self.notes.append(f"warning: {self.show(rel)}: cannot be read ({e.strerror})")
                continue
            tokens += [";"] * 4  # so that reading a cut-off use tree never runs off the end
            self.walk(rel, tokens, 0, len(tokens) - 4, module_of(rel))

    def show(self, rel: str) -> str:
        return os.path.join(self.src, rel)

    def walk(self, rel: str, T: list[str], i: int, end: int, mp: tuple[str, ...]) -> None:
        scope = self.scope_of(rel, mp)
        self.names.setdefault(scope, {})
        self.globs.setdefault(scope, [])
        while i < end:
            t = T[i]
            if t == "#" and (T[i + 1] == "[" or T[i + 1] == "!" and T[i + 2] == "["):
                inner = T[i + 1] == "!"
                j = i + 2 if inner else i + 1
                close = matching(T, j, end)
                if T[j + 1:close] != ["cfg", "(", "test", ")"]:
                    i += 1  # other attributes are read like code
                    continue
                if inner:  # #![cfg(test)]: the rest of this module is for tests
                    if not mp or scope[0] == "bin":
                        return
                    self.test_only.add(mp)
                    return
                k = close + 1
                while k < end and T[k] == "#" and T[k + 1] == "[":
                    k = matching(T, k + 1, end) + 1
                stop = item_end(T, k, end)
                item = T[k:stop]
                if "mod" in item and item[-1] == ";":
                    name = item[item.index("mod") + 1]
                    self.test_only.add(mp + (name,))
                i = stop
                continue
            if t == "mod" and is_ident(T[i + 1]) and T[i + 2] in (";", "{"):
                child = mp + (T[i + 1],)
                self.names[scope][T[i + 1]] = child
                if T[i + 2] == ";":
                    i += 3
                    continue
                close = matching(T, i + 2, end)
                if rel != "main.rs" or "lib.rs" not in self.files:
                    self.modules.setdefault(child, rel)
                self.walk(rel, T, i + 3, close, child)
                i = close + 1
                continue
            if t == "use" and T[i - 1] != "::":
                leaves: list = []
                try:
                    k = use_tree(T, i + 1, [], leaves)
                except (UseTreeError, IndexError):
                    k = i + 1
                    leaves = []
                for segs, alias, glob in leaves:
                    self.uses.append((rel, scope, segs, alias, glob))
                i = k
                continue
            if is_ident(t) and T[i + 1] == "::" and is_ident(T[i + 2]) and \
                    T[i - 1] not in ("::", "$") and \
                    not (T[i - 1] == "in" and T[i - 2] == "(" and T[i - 3] == "pub"):
                segs = [t]
                k = i + 1
                while T[k] == "::" and is_ident(T[k + 1]):
                    segs.append(T[k + 1])
                    k += 2
                self.paths.append((rel, scope, segs))
                i = k
                continue
            i += 1

    # -- resolving --------------------------------------------------------------------

    def lookup(self, scope: tuple, name: str, seen: set | None = None):
        """The module a plain name stands for in a scope: declared or imported there, or
        brought in by a glob import (`use super::*`)."""
        found = self.names.get(scope, {}).get(name)
        if found is not None:
            return found
        seen = seen or set()
        seen.add(scope)
        for g in self.globs.get(scope, []):
            gscope = ("lib", g)
            if gscope not in seen:
                found = self.lookup(gscope, name, seen)
                if found is not None:
                    return found
        return None

    def absolute(self, scope: tuple, segs: list[str]) -> tuple[str, ...] | None:
        """A path as written -> the path from the crate root, or None outside the crate."""
        kind, mp = scope
        first = segs[0]
        if first == "crate" or kind == "bin" and first == self.crate_name:
            base, rest = (), segs[1:]
        elif first in ("self", "super"):
            base, rest = mp, list(segs)
            if rest[0] == "self":
                rest = rest[1:]
            while rest and rest[0] == "super":
                if not base:
                    return None
                base, rest = base[:-1], rest[1:]
        elif first in ("::", "Self"):
            return None
        else:
            found = self.lookup(scope, first)
            if found is None:
                return None
            base, rest = found, segs[1:]
        if rest and rest[-1] == "self":  # use a::{self}
            rest = rest[:-1]
        return base + tuple(rest)

    def file_of(self, path: tuple[str, ...]) -> str | None:
        """The file of the deepest module on the path."""
        for k in range(len(path), -1, -1):
            if path[:k] in self.modules:
                return self.modules[path[:k]]
        return None

    def bind(self) -> None:
        """Works out, to a fixed point, the names `use` brings in that stand for modules."""
        for _ in range(50):
            changed = False
            for rel, scope, segs, alias, glob in self.uses:
                target = self.absolute(scope, segs)
                if target is None or target not in self.modules:
                    continue
                if glob:
                    if target not in self.globs[scope] and target != scope[1]:
                        self.globs[scope].append(target)
                        changed = True
                    continue
                name = alias or (segs[-2] if segs[-1] == "self" and len(segs) > 1 else segs[-1])
                if name in ("_", "crate", "self", "super") or not is_ident(name):
                    continue
                if self.names[scope].get(name) != target:
                    self.names[scope][name] = target
                    changed = True
            if not changed:
                return

    def edges(self) -> dict[str, dict[str, set[str]]]:
        """file -> file it names -> the paths (from the crate root) it names it by."""
        self.bind()
        out: dict[str, dict[str, set[str]]] = {rel: {} for rel in self.files}
        named = [(rel, scope, segs) for rel, scope, segs, _, _ in self.uses] + self.paths
        for rel, scope, segs in named:
            if any(module_of(rel)[:k] in self.test_only for k in range(len(module_of(rel)) + 1)):
                continue
            target = self.absolute(scope, segs)
            if target is None:
                continue
            dest = self.file_of(target)
            if dest is None or dest == rel:
                continue
            mine, theirs = module_of(rel), module_of(dest)
            if rel not in ROOTS and theirs[:len(mine)] == mine:
                continue  # a module's front naming its own submodules
            out[rel].setdefault(dest, set()).add("::".join(target) or "crate")
        return out


# ---------------------------------------------------------------------------------------
# Checking.

def circles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, nexts = work[-1]
            for w in nexts:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def top(rel: str) -> str | None:
    mp = module_of(rel)
    return mp[0] if mp and rel not in ROOTS else None


class Result:
    def __init__(self):
        self.against: list[tuple[str, str, list[str]]] = []   # (file, file, paths)
        self.circles: list[list[str]] = []
        self.ties: dict[tuple[str, str], list[str]] = {}
        self.unlisted: list[str] = []
        self.notes: list[str] = []
        self.files = 0
        self.lines: list[str] = []

    @property
    def status(self) -> int:
        return 1 if self.against or self.circles else 0


def check(src: str, crate_name: str | None = None) -> Result:
    tree = Tree(src, crate_name if crate_name is not None else package_name(src))
    tree.read()
    graph = tree.edges()
    res = Result()
    res.files = len(tree.files)
    res.notes = list(tree.notes)
    show = tree.show

    for name in sorted({top(rel) for rel in tree.files} - {None} - set(RANK)):
        where = ", ".join(show(rel) for rel in tree.files if top(rel) == name and (
            module_of(rel) == (name,)))
        res.unlisted.append(name)
        res.lines.append(f"warning: unlisted module {name} ({where}): not in the layering of"
                         f" DESIGN.md 6b, checked for circles only")
    res.lines += res.notes

    for a in sorted(graph):
        for b in sorted(graph[a]):
            ta, tb = top(a), top(b)
            if ta is None or tb is None or ta == tb or ta not in RANK or tb not in RANK:
                continue
            if RANK[tb] >= RANK[ta]:
                paths = sorted(graph[a][b])
                res.against.append((a, b, paths))
                res.lines.append(f"{show(a)} ({ta}, layer {RANK[ta]}) names {show(b)} "
                                 f"({tb}, layer {RANK[tb]}): {', '.join(paths)}")

    res.circles = circles(graph)
    for comp in res.circles:
        res.lines.append(f"circle of {len(comp)} files: {', '.join(show(f) for f in comp)}")
        for a in comp:
            for b in sorted(graph[a]):
                if b in comp:
                    res.ties[(a, b)] = sorted(graph[a][b])
                    res.lines.append(f"    {show(a)} -> {show(b)}: "
                                     f"{', '.join(sorted(graph[a][b]))}")

    res.lines.append(f"{len(res.against)} imports against the layering, {len(res.circles)} "
                     f"circles of files ({res.files} files read)")
    return res


# ---------------------------------------------------------------------------------------
# --self-test: small trees with known answers.

FIXTURES: dict[str, dict[str, str]] = {
    # Everything downward; a child names its parent; a parent names its children; a file
    # names itself; foo.rs beside foo/; an inline module's super::; a use group with self.
    "clean": {
        "lib.rs": "pub mod config; pub mod metrics; pub mod routing; pub mod gateway;\n"
                  "pub use crate::gateway::Gateway;\n",
        "main.rs": "use sluice::gateway;\nfn main() { gateway::Gateway::build(); sluice::cli::x(); }\n",
        "config/mod.rs": "mod read;\npub use read::Table;\npub use self::read::helper;\n"
                         "pub struct Config;\nfn f() -> crate::config::Config { Config }\n",
        "config/read.rs": "use super::Config;\npub struct Table;\npub fn helper() {}\n",
        "metrics.rs": "use crate::config::{self, Config};\nfn f(c: &Config) { config::read_it(); }\n",
        "routing.rs": "mod index;\nuse crate::{config::Config, metrics};\nstruct Route;\n"
                      "mod inner { use super::Route; fn f() { super::super::metrics::x(); } }\n",
        "routing/index.rs": "use super::Route;\nuse crate::metrics::Metrics;\n",
        "gateway.rs": "use crate::{metrics::{self, Metrics}, routing::{self as r, Route}};\n"
                      "pub struct Gateway;\nfn g() { r::x(); crate::config::read::helper(); }\n",
    },
    # An upward import inside a nested use group; one after a #[cfg(test)] module, through
    # a name a `use` brought in; one after strings holding `//` and a line continuation.
    "upward": {
        "lib.rs": "pub mod config; pub mod metrics; pub mod gateway; pub mod key;\n",
        "config.rs": "pub struct Config;\nfn f() {\n    let _ = \"http://host/\";\n"
                     "    let _ = \"a \\\n     b\";\n    crate::gateway::Gateway::new();\n}\n",
        "gateway/mod.rs": "pub mod build;\npub struct Gateway;\n",
        "gateway/build.rs": "pub fn x() {}\n",
        "metrics.rs": "use crate::{config::Config, gateway::{Gateway, build::{x, y as z}}};\n",
        "key.rs": "use crate::metrics::Metrics;\nuse crate::gateway as gw;\n"
                  "#[cfg(test)]\nmod tests {\n    use crate::gateway::Gateway;\n"
                  "    fn t() { let b = '{'; }\n}\n"
                  "fn after() { gw::build::x(); }\n",
    },
    # Two files that name each other through super::, with nothing against the layering.
    "circle": {
        "lib.rs": "pub mod limiter;\n",
        "limiter/mod.rs": "mod a;\nmod b;\nmod c;\n",
        "limiter/a.rs": "use super::b::Thing;\npub fn y() {}\n",
        "limiter/b.rs": "pub struct Thing { n: u8 }\nfn f() -> Thing { Thing { ..super::a::y() } }\n",
        "limiter/c.rs": "use super::{a, b};\n",
    },
    # The upward names appear only in comments, literals and test code: nothing counts.
    "hidden": {
        "lib.rs": "pub mod config; pub mod gateway; pub mod extra;\n",
        "gateway.rs": "pub struct Gateway;\n",
        "extra.rs": "use crate::gateway::Gateway;\n",
        "config/mod.rs": (
            "//! Read by crate::gateway::Gateway, which\n"
            "/// see [`crate::gateway::Gateway`]\n"
            "// use crate::gateway::Gateway;\n"
            "/* use crate::gateway::A; /* nested */ use crate::gateway::B; */\n"
            "/** crate::gateway::C */\n"
            "pub fn f<'a>(x: &'a str) -> &'a str {\n"
            "    let _ = \"crate::gateway::D \\\" crate::gateway::E\";\n"
            "    let _ = r#\"crate::gateway::F \" crate::gateway::G\"#;\n"
            "    let _ = br##\"crate::gateway::H\"# \"##;\n"
            "    let _ = b\"crate::gateway::I\";\n"
            "    let _ = ('\"', '\\'', b'\"');\n"
            "    let _ = \"}\";\n"
            "    x\n"
            "}\n"
            "#[cfg(test)]\n#[allow(unused)]\n"
            "mod tests {\n    use super::*;\n    use crate::gateway::{self, Gateway};\n"
            "    #[test]\n    fn t() { crate::gateway::x(); let _ = \"}\"; }\n}\n"
            "#[cfg(test)]\nuse crate::gateway::J;\n"
            "#[cfg(test)]\nmod fixtures;\n"
            "pub(in crate::config) fn g() {}\n"
        ),
        "config/fixtures.rs": "use crate::gateway::K;\n",
    },
}

EXPECT = {
    "clean": dict(against=set(), circles=[], unlisted=[], status=0),
    "upward": dict(against={("config.rs", "gateway/mod.rs"), ("key.rs", "gateway/build.rs"),
                            ("key.rs", "gateway/mod.rs"), ("metrics.rs", "gateway/build.rs"),
                            ("metrics.rs", "gateway/mod.rs")},
                   circles=[], unlisted=[], status=1),
    "circle": dict(against=set(), circles=[["limiter/a.rs", "limiter/b.rs"]], unlisted=[], status=1),
    "hidden": dict(against=set(), circles=[], unlisted=["extra"], status=0),
}


def self_test() -> int:
    failures = []
    base = tempfile.mkdtemp(prefix="check-layers-")
    try:
        # the lexer on its own
        toks = lex("a /* x /* y */ z */ b // c\n r#\"q\"# 'x' 'lt c \"s\\\"t\" r#match $crate::d")
        if toks != ["a", "b", '"str"', "'c'", "c", '"str"', "match", "crate", "::", "d"]:
            failures.append(f"lex: {toks}")
        leaves: list = []
        use_tree(lex("crate::a::{b, c::{d, e as f}, self, *};"), 0, [], leaves)
        got = [("::".join(s), a, g) for s, a, g in leaves]
        want = [("crate::a::b", None, False), ("crate::a::c::d", None, False),
                ("crate::a::c::e", "f", False), ("crate::a::self", None, False),
                ("crate::a", None, True)]
        if got != want:
            failures.append(f"use tree: {got}")
        for name, files in FIXTURES.items():
            root = os.path.join(base, name)
            for rel, text in files.items():
                path = os.path.join(root, "src", rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            with open(os.path.join(root, "Cargo.toml"), "w", encoding="utf-8") as f:
                f.write('[package]\nname = "sluice"\n')
            res = check(os.path.join(root, "src"))
            got = dict(against={(a, b) for a, b, _ in res.against}, circles=res.circles,
                       unlisted=res.unlisted, status=res.status)
            ok = got == EXPECT[name] and res.files == len(files)
            print(f"self-test {name}: {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(f"{name}: got {got}, want {EXPECT[name]}")
                for line in res.lines:
                    print("    " + line)
        # the summary line and the ties of the circle
        res = check(os.path.join(base, "circle", "src"))
        if res.lines[-1] != "0 imports against the layering, 1 circles of files (5 files read)":
            failures.append(f"summary: {res.lines[-1]}")
        if res.ties != {("limiter/a.rs", "limiter/b.rs"): ["limiter::b::Thing"],
                        ("limiter/b.rs", "limiter/a.rs"): ["limiter::a::y"]}:
            failures.append(f"ties: {res.ties}")
        res = check(os.path.join(base, "upward", "src"))
        paths = {(a, b): p for a, b, p in res.against}
        if paths != {("config.rs", "gateway/mod.rs"): ["gateway::Gateway::new"],
                     ("key.rs", "gateway/build.rs"): ["gateway::build::x"],
                     ("key.rs", "gateway/mod.rs"): ["gateway"],
                     ("metrics.rs", "gateway/build.rs"): ["gateway::build::x", "gateway::build::y"],
                     ("metrics.rs", "gateway/mod.rs"): ["gateway::Gateway"]}:
            failures.append(f"paths: {paths}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for f in failures:
        print("self-test failed: " + f)
    print(f"self-test: {'ok' if not failures else f'{len(failures)} failures'}")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--self-test"]:
        return self_test()
    if argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) > 2 or argv[1:] and argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    src = argv[1] if len(argv) > 1 else "src"
    if not os.path.isdir(src):
        print(f"check-layers: {src}: not a directory", file=sys.stderr)
        return 2
    res = check(src)
    print("\n".join(res.lines))
    return res.status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
