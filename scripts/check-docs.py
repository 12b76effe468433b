#!/usr/bin/env python3
"""Check the relative links of README.md and docs/**/*.md.

For every Markdown link or image `[text](target)`, every reference definition
`[label]: target` and every HTML `<a href>` / `<img src>` outside code (fenced and
indented code blocks, inline code spans), check that the target file or directory
exists (relative to the Markdown file's directory; a leading `/` means the repository
root) and, for a `#anchor` (also a bare `#anchor` in the same file), that the target
Markdown file has a heading producing that anchor under GitHub's rules (lower case,
punctuation other than `-` and `_` dropped, each space a `-`, duplicates suffixed
`-1`, `-2`, ...) or an explicit `<a id="...">` / `<a name="...">`. Targets with a URI
scheme (http:, https:, mailto:, ...) are not checked.

    python3 scripts/check-docs.py               # exit 1 and FILE:LINE: target — reason per broken link
    python3 scripts/check-docs.py --self-test   # the checker against a planted good and bad tree
    python3 scripts/check-docs.py --root DIR    # another tree than this script's repository

Standard library only.
"""

import argparse
import html
import os
import re
import sys
import tempfile
import urllib.parse

SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
FENCE = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")
LIST_ITEM = re.compile(r"^( *)([-*+]|\d{1,9}[.)])( +|$)")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
REF_DEF = re.compile(r"^ {0,3}\[((?:[^\[\]\\]|\\.)+)\]:[ \t]*(<[^>\n]*>|\S+)")
# [text](target "title"): the text may hold one level of nested brackets.
INLINE_LINK = re.compile(
    r"\[(?:[^\[\]\\]|\\.|\[(?:[^\[\]\\]|\\.)*\])*\]"
    r"\([ \t]*(<[^>\n]*>|(?:[^()\s]|\((?:[^()\s])*\))+)"
    r"(?:[ \t]+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?[ \t]*\)"
)
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(href|src)\s*=\s*(\"[^\"]*\"|'[^']*')", re.I)
HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:id|name)\s*=\s*(\"[^\"]*\"|'[^']*')", re.I)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def indent_of(line):
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip(" "))


def blank_code_spans(text):
    """Replace inline code spans (backtick runs matched by a run of the same length)
    with spaces, keeping newlines, so offsets and line numbers stay where they were."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        if text[i] == "\\" and i + 1 < n:
            i += 2
            continue
        if text[i] != "`":
            i += 1
            continue
        j = i
        while j < n and text[j] == "`":
            j += 1
        run = j - i
        k = j
        close = -1
        while k < n:
            if text[k] == "`":
                m = k
                while m < n and text[m] == "`":
                    m += 1
                if m - k == run:
                    close = k
                    break
                k = m
            else:
                k += 1
        if close < 0:
            i = j  # an unmatched run is literal backticks
            continue
        for p in range(i, close + run):
            if out[p] != "\n":
                out[p] = " "
        i = close + run
    return "".join(out)


def split_blocks(lines):
    """Yield (first_line_number, text, is_heading_line_list) for the prose of a
    Markdown file: runs of consecutive non-blank lines outside code blocks.
    Returns a list of (start_lineno, [lines])."""
    blocks = []
    cur, cur_start = [], 0
    fence = None  # (char, length, indent)
    in_indented = False
    lists = []  # content columns of the open list items
    prev_blank = True

    def flush():
        nonlocal cur
        if cur:
            blocks.append((cur_start, cur))
        cur = []

    for no, line in enumerate(lines, 1):
        if fence:
            m = FENCE.match(line)
            if m and m.group(2)[0] == fence[0] and len(m.group(2)) >= fence[1] and not m.group(3).strip():
                fence = None
            prev_blank = False
            continue
        if not line.strip():
            flush()
            prev_blank = True
            continue
        ind = indent_of(line)
        if in_indented:
            base = lists[-1] if lists else 0
            if ind >= base + 4:
                continue
            in_indented = False
        if prev_blank:
            while lists and ind < lists[-1] and not LIST_ITEM.match(line):
                lists.pop()
            base = lists[-1] if lists else 0
            if ind >= base + 4:
                flush()
                in_indented = True
                prev_blank = False
                continue
        m = FENCE.match(line)
        if m and (m.group(2)[0] == "~" or "`" not in m.group(3)):
            flush()
            fence = (m.group(2)[0], len(m.group(2)), len(m.group(1)))
            prev_blank = False
            continue
        m = LIST_ITEM.match(line)
        if m:
            col = len(m.group(1)) + len(m.group(2)) + (len(m.group(3)) if 0 < len(m.group(3)) <= 4 else 1)
            while lists and lists[-1] > len(m.group(1)):
                lists.pop()
            lists.append(col)
        if not cur:
            cur_start = no
        cur.append(line)
        prev_blank = False
    flush()
    return blocks


def strip_inline(text):
    """Heading text as GitHub renders it, before the slug: links and images keep
    their text, HTML tags and entities go."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return html.unescape(text)


def slugify(text):
    text = strip_inline(text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


class Slugger:
    """github-slugger: the first use of a slug is bare, later ones get -1, -2, ..."""

    def __init__(self):
        self.seen = {}

    def slug(self, text):
        base = slugify(text)
        slug = base
        while slug in self.seen:
            self.seen[base] += 1
            slug = f"{base}-{self.seen[base]}"
        self.seen[slug] = 0
        return slug


def parse(path):
    """Return (anchors, links) of one Markdown file; links are (line, target)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    anchors = set()
    links = []
    slugger = Slugger()
    for start, block in split_blocks(lines):
        # Headings: ATX on any line of the block, setext on the line before === / ---.
        for i, line in enumerate(block):
            m = ATX.match(line)
            if m and not line.lstrip().startswith("#" * 7):
                anchors.add(slugger.slug(m.group(2) or ""))
            elif i > 0 and SETEXT.match(line) and not ATX.match(block[i - 1]):
                if i == 1 or not SETEXT.match(block[i - 1]):
                    anchors.add(slugger.slug(" ".join(block[:i]).strip()))
        text = HTML_COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(block))
        text = blank_code_spans(text)
        for m in HTML_ANCHOR.finditer(text):
            anchors.add(m.group(1)[1:-1])

        def line_of(offset):
            return start + text.count("\n", 0, offset)

        for m in INLINE_LINK.finditer(text):
            links.append((line_of(m.start(1)), m.group(1)))
        for m in HTML_ATTR.finditer(text):
            links.append((line_of(m.start(2)), html.unescape(m.group(2)[1:-1])))
        offset = 0
        for line in text.split("\n"):
            m = REF_DEF.match(line)
            if m:
                links.append((line_of(offset + m.start(2)), m.group(2)))
            offset += len(line) + 1
    return anchors, links


def markdown_files(root):
    files = []
    readme = os.path.join(root, "README.md")
    if os.path.isfile(readme):
        files.append(readme)
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "docs")):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".md"):
                files.append(os.path.join(dirpath, name))
    return files


def check(root):
    """Return (broken, files, links checked); broken is [(file, line, target, reason)]."""
    root = os.path.realpath(root)
    files = markdown_files(root)
    cache = {}

    def info(path):
        if path not in cache:
            cache[path] = parse(path)
        return cache[path]

    broken = []
    checked = 0
    for path in files:
        rel = os.path.relpath(path, root)
        for line, raw in info(path)[1]:
            target = raw[1:-1] if raw.startswith("<") and raw.endswith(">") else raw
            if SCHEME.match(target) or target.startswith("//"):
                continue
            checked += 1
            where, _, fragment = target.partition("#")
            where = urllib.parse.unquote(where.partition("?")[0])
            if not where:
                dest = path
            elif where.startswith("/"):
                dest = os.path.join(root, where.lstrip("/"))
            else:
                dest = os.path.join(os.path.dirname(path), where)
            dest = os.path.realpath(dest)
            if dest != root and not dest.startswith(root + os.sep):
                broken.append((rel, line, raw, "points outside the repository"))
                continue
            if not os.path.exists(dest):
                broken.append((rel, line, raw, f"no such file: {os.path.relpath(dest, root)}"))
                continue
            if not fragment:
                continue
            if os.path.isdir(dest) or not dest.lower().endswith((".md", ".markdown")):
                continue  # anchors of other files (e.g. #L10 of source) are GitHub's business
            fragment = urllib.parse.unquote(fragment)
            anchors = info(dest)[0]
            if fragment in anchors:
                continue
            name = os.path.relpath(dest, root)
            if fragment.lower() in anchors:
                reason = f"anchor #{fragment} differs in case from a heading of {name}"
            else:
                reason = f"no heading or <a id> makes #{fragment} in {name}"
            broken.append((rel, line, raw, reason))
    return broken, len(files), checked


SELF_TEST_FILES = {
    "README.md": """# Project

[guide](docs/guide.md) and [its setup](docs/guide.md#setting-up-v2) and
[the same twice](docs/guide.md#faq-1) and [code heading](docs/guide.md#the-server-table).
![picture](docs/pic.png) <img src="docs/pic.png" alt="x">
[here](#project) [web](https://example.com/missing) [mail](mailto:a@b.c)
[explicit](docs/guide.md#custom-spot) [dir](docs/)
[gone](docs/missing.md)
[bad anchor](docs/guide.md#setting-up)
[bad same-file anchor](#nowhere)

```
[in a fence](nowhere.md)
```

    [indented code](nowhere-either.md)

Inline code `[not a link](nope.md)` is skipped.

[ref]: docs/guide.md#faq
[badref]: docs/absent.md
""",
    "docs/guide.md": """# Guide

## Setting up (v2)

## FAQ

## FAQ

## The `[server]` table

<a id="custom-spot"></a>

- a list item

  [in the item](../README.md#project), [wrong dup](#faq-2)

      [code in the item](absent-in-item.md)
""",
    "docs/pic.png": "",
}

SELF_TEST_EXPECTED = {
    ("README.md", 8, "docs/missing.md"),
    ("README.md", 9, "docs/guide.md#setting-up"),
    ("README.md", 10, "#nowhere"),
    ("README.md", 21, "docs/absent.md"),
    (os.path.join("docs", "guide.md"), 15, "#faq-2"),
}


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in SELF_TEST_FILES.items():
            path = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        broken, files, checked = check(tmp)
    found = {(f, line, target) for f, line, target, _ in broken}
    ok = True
    for item in sorted(SELF_TEST_EXPECTED - found):
        print(f"self-test: missed the bad link {item[0]}:{item[1]}: {item[2]}")
        ok = False
    for item in sorted(found - SELF_TEST_EXPECTED):
        print(f"self-test: flagged a good link {item[0]}:{item[1]}: {item[2]}")
        ok = False
    if len(broken) != len(found):
        print("self-test: a link was reported twice")
        ok = False
    if checked != 16:
        print(f"self-test: checked {checked} links, expected 16 (code was not skipped, or links were missed)")
        ok = False
    if not ok:
        return 1
    print(f"self-test: ok ({len(found)} bad links found, {checked - len(found)} good ones passed, {files} files)")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--self-test", action="store_true", help="check the checker on a planted tree")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="repository root (default: this script's repository)")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    broken, files, checked = check(args.root)
    for rel, line, target, reason in broken:
        print(f"{rel}:{line}: {target} \u2014 {reason}")
    if broken:
        print(f"check-docs: {len(broken)} broken of {checked} links in {files} files", file=sys.stderr)
        return 1
    print(f"check-docs: {files} files, {checked} links checked, none broken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
