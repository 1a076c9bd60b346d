#!/usr/bin/env python3
"""results/README.md's headline table and folder index, written from the folders' own summaries.

Each folder of results/ holds a summary.toml: its line in the index (what it holds, how to re-run
it, how long that takes) and its headline rows (what was measured, the figure, ranks and sizes,
date, commit, where the detail is). This script writes the two generated blocks of
results/README.md from them, so the headline cannot drift from the folders.

    scripts/results-index.py           rewrite results/README.md's generated blocks
    scripts/results-index.py --check   change nothing; exit 1 naming each problem:
                                       a generated block out of date, a folder of results/
                                       without summary.toml, a file at results/ that no
                                       summary names, a relative link in a tracked .md
                                       file (README, docs/, results/, ...) whose file or
                                       heading anchor does not exist

Links inside a summary's texts are relative to results/README.md, where they end up; `detail`
paths are relative to the folder. Needs Python 3.11 (tomllib) and nothing else.
"""
import os
import posixpath
import re
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11
    sys.exit("scripts/results-index.py needs Python 3.11 or newer (tomllib); this is " + sys.version.split()[0])

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results")
README = os.path.join(RESULTS, "README.md")
BEGIN = "<!-- BEGIN {name}: written by scripts/results-index.py from results/*/summary.toml; edit those -->"
END = "<!-- END {name} -->"
FOLDER_KEYS = {"page", "holds", "rerun", "time", "headline"}
HEADLINE_KEYS = {"order", "what", "figure", "scope", "date", "commit", "detail"}


def cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def load_summaries(problems):
    """Every folder's summary, sorted by folder name; a folder without one is a problem."""
    summaries = []
    for name in sorted(os.listdir(RESULTS)):
        folder = os.path.join(RESULTS, name)
        if not os.path.isdir(folder):
            continue
        path = os.path.join(folder, "summary.toml")
        if not os.path.exists(path):
            problems.append(f"results/{name}/ has no summary.toml, so results/README.md does not index it")
            continue
        try:
            with open(path, "rb") as f:
                summary = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            problems.append(f"results/{name}/summary.toml: {e}")
            continue
        unknown = set(summary) - FOLDER_KEYS
        missing = {"holds", "rerun", "time"} - set(summary)
        if unknown or missing:
            problems.append(f"results/{name}/summary.toml: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
            continue
        for i, row in enumerate(summary.get("headline", [])):
            if set(row) != HEADLINE_KEYS:
                problems.append(f"results/{name}/summary.toml: headline {i + 1} has keys {sorted(row)}, wants {sorted(HEADLINE_KEYS)}")
        summary["name"] = name
        summaries.append(summary)
    return summaries


def results_path(name, relative):
    """A path relative to folder `name`, as seen from results/ (anchor kept)."""
    path, _, anchor = relative.partition("#")
    joined = posixpath.normpath(posixpath.join(name, path))
    return joined + ("#" + anchor if anchor else "")


def link(target):
    """A Markdown link from results/README.md; the text drops README.md and the anchor."""
    text = target.partition("#")[0]
    if text.endswith("/README.md"):
        text = text[: -len("README.md")]
    return f"[`{text}`]({target})"


def headline_block(summaries):
    rows = [(row["order"], s["name"], row) for s in summaries for row in s.get("headline", []) if set(row) == HEADLINE_KEYS]
    lines = ["| what | figure | ranks, sizes | date | commit | detail |", "|---|---|---|---|---|---|"]
    for _, name, row in sorted(rows, key=lambda r: (r[0], r[1])):
        detail = ", ".join(link(results_path(name, d)) for d in row["detail"])
        lines.append(f"| {cell(row['what'])} | {cell(row['figure'])} | {cell(row['scope'])} | {row['date']} | {row['commit']} | {detail} |")
    return lines


def index_block(summaries):
    lines = ["| folder | what it holds | re-run | time on 2 cores |", "|---|---|---|---|"]
    for s in summaries:
        name = s["name"]
        page = results_path(name, s.get("page", "README.md"))
        if page.startswith(name + "/"):
            # The folder's own page: the folder's name links to it.
            where = f"[`{name}/`]({page})"
        else:
            # A page beside the folder (results/X.md with its rows in results/X/).
            where = f"[`{page}`]({page}), [`{name}/`]({name}/)"
        lines.append(f"| {where} | {cell(s['holds'])} | {cell(s['rerun'])} | {cell(s['time'])} |")
    return lines


def replace_block(text, name, lines, problems):
    begin, end = BEGIN.format(name=name), END.format(name=name)
    if text.count(begin) != 1 or text.count(end) != 1:
        problems.append(f"results/README.md must hold exactly one `{begin}` and one `{end}`")
        return text
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + tail


def unnamed_files(summaries):
    """Files at results/ itself (not in a folder) that no summary names as its page."""
    pages = {results_path(s["name"], s.get("page", "README.md")) for s in summaries}
    return [f for f in sorted(os.listdir(RESULTS))
            if os.path.isfile(os.path.join(RESULTS, f)) and f != "README.md" and f not in pages]


# --- links -----------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\".*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def slug(heading):
    """GitHub's anchor for a heading: formatting dropped, lower case, punctuation but - and _ dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, seen, in_fence = set(), {}, False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if FENCE.match(line):
                    in_fence = not in_fence
                    continue
                if in_fence:
                    continue
                found.update(HTML_ANCHOR.findall(line))
                m = HEADING.match(line)
                if m:
                    base = slug(m.group(1))
                    n = seen.get(base, 0)
                    seen[base] = n + 1
                    found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def markdown_files():
    def git(*args):
        return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout
    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel").strip()) != os.path.realpath(ROOT):
            raise OSError("inside another checkout")
        files = git("ls-files", "--cached", "--others", "--exclude-standard", "*.md").split()
    except (OSError, subprocess.CalledProcessError):
        # Not a checkout of its own (an unpacked tarball): walk the tree, skipping build outputs.
        skip = {"target", ".git", "datasets"}
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".venv")]
            files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames if f.endswith(".md")]
    # tests/fixtures/ holds expected outputs (a report whose links name files the test writes).
    return sorted(f for f in set(files) if not f.startswith("tests/fixtures/"))


def broken_links(relative_md):
    problems = []
    source = os.path.join(ROOT, relative_md)
    in_fence = False
    with open(source, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        bare = INLINE_CODE.sub("", line)
        targets = LINK.findall(bare)
        m = REFERENCE.match(bare)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # http:, https:, mailto: ...
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
            where = f"{relative_md}:{number}"
            if not os.path.exists(resolved):
                problems.append(f"{where}: link to `{target}`: no such file")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                problems.append(f"{where}: link to `{target}`: {os.path.relpath(resolved, ROOT)} has no heading #{anchor}")
    return problems


def main():
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] not in ([], ["--check"]):
        sys.exit(__doc__)
    problems = []
    summaries = load_summaries(problems)
    for f in unnamed_files(summaries):
        problems.append(f"results/{f} is named by no folder's summary.toml (`page = \"../{f}\"`), so results/README.md does not index it")
    with open(README, encoding="utf-8") as f:
        current = f.read()
    wanted = replace_block(current, "headline", headline_block(summaries), problems)
    wanted = replace_block(wanted, "index", index_block(summaries), problems)
    if check:
        if wanted != current:
            problems.append("results/README.md's generated blocks differ from results/*/summary.toml: run scripts/results-index.py")
        for md in markdown_files():
            problems += broken_links(md)
    elif wanted != current:
        with open(README, "w", encoding="utf-8") as f:
            f.write(wanted)
        print("results/README.md rewritten")
    for p in problems:
        print(p, file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
