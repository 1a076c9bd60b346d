//! The documentation's links and results/README.md's generated tables, through
//! scripts/results-index.py: every folder of results/ indexed, the headline table what the
//! folders' summary.toml files say, and every relative link in the tracked Markdown files
//! (README, docs/, results/, jobs/, ...) reaching a file and, where it names one, a heading.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SCRIPT: &str = "scripts/results-index.py";

fn run(root: &Path, args: &[&str]) -> Output {
    Command::new("python3")
        .arg(root.join(SCRIPT))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("python3 {SCRIPT}: {e} (python3 3.11 or newer is needed)"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_repository_has_no_broken_link_and_an_index_of_every_results_folder() {
    let out = run(Path::new(env!("CARGO_MANIFEST_DIR")), &["--check"]);
    assert!(out.status.success(), "{SCRIPT} --check found problems:\n{}", stderr(&out));
}

/// A copy of the script in a scratch tree (not a git checkout, so it walks the files) with one
/// of each problem: the check must name every one, and writing must repair the tables only.
#[test]
fn the_check_names_a_missing_summary_a_stale_table_and_broken_links() {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("docs-check");
    let _ = fs::remove_dir_all(&root);
    for dir in ["scripts", "results/indexed", "results/unindexed", "docs"] {
        fs::create_dir_all(root.join(dir)).unwrap();
    }
    fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(SCRIPT), root.join(SCRIPT)).unwrap();
    fs::write(
        root.join("results/README.md"),
        "# Results\n\n<!-- BEGIN headline: written by scripts/results-index.py from results/*/summary.toml; edit those -->\n\
         <!-- END headline -->\n\n## Folders\n\n\
         <!-- BEGIN index: written by scripts/results-index.py from results/*/summary.toml; edit those -->\n<!-- END index -->\n",
    )
    .unwrap();
    fs::write(
        root.join("results/indexed/summary.toml"),
        "holds = \"rows\"\nrerun = \"`scripts/x.sh`\"\ntime = \"1 min\"\n\n[[headline]]\norder = 1\nwhat = \"a figure\"\n\
         figure = \"2x\"\nscope = \"2 ranks\"\ndate = \"2026-11-29\"\ncommit = \"abc\"\ndetail = [\"README.md#figures\"]\n",
    )
    .unwrap();
    fs::write(root.join("results/indexed/README.md"), "# Indexed\n\n## Figures\n").unwrap();
    fs::write(root.join("results/stray.md"), "# Stray\n").unwrap();
    fs::write(
        root.join("docs/page.md"),
        "# Page\n\n## A heading\n\n[fine](#a-heading) [fine](../results/indexed/README.md#figures) \
         [gone](missing.md) [no heading](../results/indexed/README.md#nowhere) `[code](not-a-link.md)`\n\
         ```\n[fenced](not-a-link-either.md)\n```\n",
    )
    .unwrap();

    let out = run(&root, &["--check"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for expected in [
        "results/unindexed/ has no summary.toml",
        "results/stray.md is named by no folder's summary.toml",
        "results/README.md's generated blocks differ",
        "docs/page.md:5: link to `missing.md`: no such file",
        "docs/page.md:5: link to `../results/indexed/README.md#nowhere`: results/indexed/README.md has no heading #nowhere",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    assert_eq!(err.lines().count(), 5, "one line per problem, nothing else:\n{err}");

    // Writing fills the tables from the summary; what it cannot fix is still reported.
    run(&root, &[]);
    let readme = fs::read_to_string(root.join("results/README.md")).unwrap();
    assert!(readme.contains("| a figure | 2x | 2 ranks | 2026-11-29 | abc | [`indexed/`](indexed/README.md#figures) |"), "{readme}");
    assert!(readme.contains("| [`indexed/`](indexed/README.md) | rows | `scripts/x.sh` | 1 min |"), "{readme}");
    let err = stderr(&run(&root, &["--check"]));
    assert!(!err.contains("generated blocks differ"), "{err}");
    assert_eq!(err.lines().count(), 4, "{err}");
    let _ = fs::remove_dir_all(&root);
}
