#!/usr/bin/env python3
"""Moves the non-template function definitions of a trainkit header into its -inl.hpp file.

    tools/split_inline.py include/trainkit/storage/storage.hpp [--min-lines N]

For the compiled mode (TRAINKIT_COMPILED_LIB, docs/design/compiled-mode.md): every member
function defined inside a non-template class, and every namespace-level `inline` function, whose
body has at least N lines (default 2) becomes a declaration in the header and a definition,
marked TRAINKIT_INLINE, in <header>-inl.hpp next to it (appended when the file exists). Template
classes and template functions are left alone; so are one-line accessors. What the script cannot
qualify (a return type naming a nested type of the class) the compiler says, and is fixed by hand.
"""
import argparse
import re
import sys
from pathlib import Path

DROP_WORDS = ("static ", "virtual ", "explicit ", "inline ")


def top_level_split(text, sep=","):
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def strip_defaults(params):
    if not params.strip():
        return params
    out = []
    for p in top_level_split(params):
        eq = None
        depth = 0
        for i, ch in enumerate(p):
            if ch in "(<[{":
                depth += 1
            elif ch in ")>]}":
                depth -= 1
            elif ch == "=" and depth == 0 and p[i - 1] not in "=!<>" and (i + 1 >= len(p) or p[i + 1] != "="):
                eq = i
                break
        out.append(p[:eq].rstrip() if eq is not None else p)
    return ",".join(out)


def matching(text, i, open_ch, close_ch):
    depth = 0
    in_str = None
    j = i
    while j < len(text):
        ch = text[j]
        if in_str:
            if ch == "\\":
                j += 2
                continue
            if ch == in_str:
                in_str = None
        elif ch in "\"'":
            in_str = ch
        elif text.startswith("//", j):
            j = text.index("\n", j)
            continue
        elif ch == open_ch:
            depth += 1
        elif ch == close_ch:
            depth -= 1
            if depth == 0:
                return j
        j += 1
    raise ValueError("unbalanced")


def split(path, min_lines):
    text = path.read_text()
    lines = text.split("\n")
    out_header = []
    definitions = []  # (namespace path, text)
    ns_stack = []  # names, one per open namespace
    class_stack = []  # (name, depth at which its body is, is_template)
    depth = 0
    i = 0
    pending_template = False
    previous = ""
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        m_ns = re.match(r"namespace ([\w:]+) \{$", stripped)
        if m_ns:
            ns_stack.append((m_ns.group(1), depth + 1))
        m_cls = re.match(r"(?:template <.*>\s*)?(class|struct) (\w+(?:<[^{]*?>)?)( final)?(\s*:[^;{]*)?\s*\{$", stripped)
        if m_cls:
            specialization = previous.strip() == "template <>"
            class_stack.append((m_cls.group(2), depth + 1,
                                (pending_template and not specialization) or stripped.startswith("template")))
        in_class = class_stack and class_stack[-1][1] == depth
        at_namespace = bool(ns_stack) and ns_stack[-1][1] == depth and not in_class
        candidate = (
            not m_cls and not m_ns and not pending_template
            and not stripped.startswith(("//", "#", "template", "using ", "friend ", "return", "typedef"))
            and "(" in stripped
            and ((in_class and not any(c[2] for c in class_stack)) or (at_namespace and stripped.startswith("inline ")))
        )
        if candidate:
            # Gather the statement up to its body's '{' (or a ';': a declaration).
            j = i
            sig = ""
            while True:
                sig += lines[j] + "\n"
                s = lines[j].split("//")[0].rstrip()
                if "{" in s and s.endswith("}"):
                    break  # a one-line definition: stays where it is
                if s.endswith(";") and sig.count("(") == sig.count(")"):
                    break
                if s.endswith("{") and sig.count("(") == sig.count(")") and not s.endswith("= {"):
                    break
                j += 1
            if sig.split("//")[-1].rstrip().endswith("{") and sig.rstrip().endswith("{") and not re.search(r"\)\s*(const\s*)?(override\s*)?(noexcept\s*)?=\s*default", sig):
                body_start = text_offset(lines, j) + len(lines[j].rstrip()) - 1
                body_end = matching(text, body_start, "{", "}")
                end_line = text[:body_end].count("\n")
                if end_line - j >= min_lines:
                    owner = "::".join(c[0] for c in class_stack) if in_class else None
                    decl, definition = transform(sig, owner, text[body_start:body_end + 1])
                    indent = re.match(r"\s*", lines[i]).group(0)
                    # A member defined at namespace level (X::f) is declared in its class already.
                    qualified_member = not in_class and re.search(r"\w::~?\w+\s*\(", decl.split("(")[0] + "(")
                    if not qualified_member:
                        # A virtual member's declaration is marked too: declared without `inline`,
                        # it would be its class's key function, and header-only every file would
                        # emit the class's vtable and virtual functions.
                        if in_class and (re.search(r"\b(override|final)\s*;$", decl) or decl.startswith("virtual ")):
                            decl = "TRAINKIT_INLINE " + decl.replace("\n", "\n" + " " * len("TRAINKIT_INLINE "))
                        out_header.append(indent + decl)
                    namespaces = [n for n, _ in ns_stack]
                    definitions.append((namespaces, definition))
                    # trailing text after the closing brace on its line (e.g. "};" never for functions)
                    i = end_line + 1
                    continue
        # depth bookkeeping
        depth += brace_delta(line)
        while class_stack and depth < class_stack[-1][1]:
            class_stack.pop()
        while ns_stack and depth < ns_stack[-1][1]:
            ns_stack.pop()
        pending_template = stripped.startswith("template") and not stripped.endswith(";") and "{" not in stripped
        previous = line
        out_header.append(line)
        i += 1
    return "\n".join(out_header), definitions


def text_offset(lines, j):
    return sum(len(l) + 1 for l in lines[:j])


def brace_delta(line):
    code = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    code = re.sub(r"'(\\.|[^'\\])*'", "''", code)
    code = code.split("//")[0]
    return code.count("{") - code.count("}")


def transform(sig, cls, body):
    sig = sig.rstrip()
    assert sig.endswith("{")
    head = sig[:-1].rstrip()
    # The parameter list: the first top-level '(' after the name.
    lead = re.match(r"\s*", head).group(0)
    head_flat = " ".join(part.strip() for part in head.split("\n"))
    open_i = head_flat.index("(")
    # operators: "operator()("
    if head_flat[:open_i].endswith("operator"):
        open_i = head_flat.index("(", open_i + 2)
    close_i = matching(head_flat, open_i, "(", ")")
    before = head_flat[:open_i]
    params = head_flat[open_i + 1:close_i]
    after = head_flat[close_i + 1:]
    init = ""
    m_init = re.match(r"\s*(const\s*)?(noexcept\s*)?(override\s*)?(final\s*)?(:.*)?$", after)
    qualifiers = after
    if m_init and m_init.group(5):
        init = m_init.group(5)
        qualifiers = after[:after.index(init)]
    decl = re.sub(r"^(\s*)inline ", r"\1", before) + "(" + params + ")" + qualifiers.rstrip() + ";"
    name_m = re.search(r"(~?\w+|operator\W+)\s*$", before)
    name_start = name_m.start()
    ret = before[:name_start]
    for w in DROP_WORDS:
        ret = ret.replace(w, "")
    qual = qualifiers.replace("override", "").replace("final", "").rstrip()
    qualified = (cls + "::" if cls else "") + before[name_start:].strip()
    signature = "TRAINKIT_INLINE " + ret.strip() + (" " if ret.strip() else "") + qualified + "(" + \
        strip_defaults(params) + ")" + (" " + qual.strip() if qual.strip() else "")
    definition = wrap(signature, "")
    if init:
        definition += "\n    " + init.strip()
    definition += " " + dedent_body(body)
    return wrap(decl.strip(), lead), definition


def wrap(line, indent, limit=118):
    """Breaks a long signature after a top-level comma, continuing under its '('."""
    if len(indent) + len(line) <= limit or "(" not in line:
        return line
    open_i = line.index("(")
    out, cur = [], ""
    for k, part in enumerate(top_level_split(line[open_i + 1:])):
        piece = part if k == 0 else "," + part
        if cur and len(indent) + len(cur) + len(piece) > limit:
            out.append(cur + ",")
            cur = " " * (open_i + 1) + piece[1:].lstrip()
        else:
            cur += piece
        if k == 0:
            cur = line[:open_i + 1] + cur
    out.append(cur)
    return ("\n" + indent).join(out)


def dedent_body(body):
    lines = body.split("\n")
    if len(lines) == 1:
        return body
    last = lines[-1]
    indent = len(last) - len(last.lstrip())
    out = [lines[0]]
    for l in lines[1:]:
        out.append(l[indent:] if l[:indent].strip() == "" else l)
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("header")
    ap.add_argument("--min-lines", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.header)
    header, definitions = split(path, args.min_lines)
    if not definitions:
        print(f"{path}: nothing to move", file=sys.stderr)
        return
    inl = path.with_name(path.stem + "-inl.hpp")
    blocks = []
    current = None
    for ns, d in definitions:
        if ns != current:
            if current is not None:
                blocks.append("".join("}  // namespace " + n + "\n" for n in reversed(current)))
            blocks.append("".join("namespace " + n + " {\n" for n in ns) + "\n")
            current = ns
        blocks.append(d + "\n\n")
    blocks.append("".join("}  // namespace " + n + "\n" for n in reversed(current)))
    rel = path.as_posix().split("include/")[-1]
    if inl.exists():
        existing = inl.read_text()
        inl.write_text(existing + "\n" + "".join(blocks))
    else:
        inl.write_text("#pragma once\n/// The definitions of " + rel + " (header-only: included by it; compiled mode:\n"
                       "/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.\n"
                       "#include <" + rel + ">\n\n" + "".join(blocks))
    if "<trainkit/detail/inline.hpp>" not in header:
        header = header.replace("#include <", "#include <trainkit/detail/inline.hpp>\n#include <", 1)
    header = header.rstrip("\n") + "\n\n#ifndef TRAINKIT_COMPILED_LIB\n#include <" + rel[:-4] + "-inl.hpp>\n#endif\n"
    path.write_text(header)
    print(f"{path}: {len(definitions)} definitions moved to {inl}", file=sys.stderr)


if __name__ == "__main__":
    main()
