//! The points of a sweep as the job files record them (jobs/common.sh appends one line to
//! `points.jsonl` beside `runs.jsonl` when each point ends, whatever its exit status): the
//! report lists those that failed, which left no run record to show.

use std::fmt::Write as _;
use std::path::Path;

use serde::Deserialize;

use crate::error::Result;
use crate::results;

/// The file looked for beside the runs file when `--points` is not given.
pub const POINTS_FILE: &str = "points.jsonl";

/// One point of a sweep: a launch of hpc-train at one rank count (and strategy), and how it ended.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct PointRecord {
    pub study: String,
    /// What the job file launched: "<strategy>-<ranks>", "bench-<ranks>", "<strategy>-<ranks>-pp<P>".
    pub point: String,
    #[serde(default)]
    pub strategy: Option<String>,
    pub ranks: usize,
    pub exit_code: i32,
    /// Stopped by a signal to the job, after writing a checkpoint (exit 143 after a signal).
    #[serde(default)]
    pub stopped: bool,
    #[serde(default)]
    pub start: Option<String>,
    #[serde(default)]
    pub end: Option<String>,
    /// The point's own log.
    #[serde(default)]
    pub log: Option<String>,
}

/// The points of `path` (of one study when given) that failed: the last line of each point
/// decides, so that a point that failed and then succeeded on a later try (a requeued job) is
/// not listed. In the order of their last lines.
pub fn failed(path: &Path, study: Option<&str>) -> Result<Vec<PointRecord>> {
    let all = results::read_json_lines::<PointRecord>(path)?;
    Ok(last_failed(all, study))
}

fn last_failed(all: Vec<PointRecord>, study: Option<&str>) -> Vec<PointRecord> {
    let mut last: Vec<PointRecord> = Vec::new();
    for p in all.into_iter().filter(|p| study.is_none_or(|s| p.study == s)) {
        last.retain(|q| !(q.study == p.study && q.point == p.point));
        last.push(p);
    }
    last.retain(|p| p.exit_code != 0);
    last
}

/// What an exit status of hpc-train (or of its launcher) means.
pub fn meaning(code: i32, stopped: bool) -> &'static str {
    match code {
        143 if stopped => "stopped by a signal after writing a checkpoint (resume it)",
        143 => "terminated (SIGTERM; srun ends a step's ranks when one fails)",
        137 => "killed (SIGKILL: the time limit's end, or out of memory)",
        1 => "error (see the log)",
        _ => "failed (see the log)",
    }
}

/// The report's section on failed points.
pub fn section(path: &Path, points: &[PointRecord]) -> String {
    let mut out = String::from("## Failed points\n\n");
    let _ = writeln!(
        out,
        "From `{}`: {} point{} of the sweep ended with a non-zero exit status and left no run in the tables above.\n",
        path.display(),
        points.len(),
        if points.len() == 1 { "" } else { "s" }
    );
    out.push_str("| Point | Strategy | Ranks | Exit status | Meaning | Started | Ended | Log |\n|---|---|---|---|---|---|---|---|\n");
    for p in points {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            p.point,
            p.strategy.as_deref().unwrap_or("—"),
            p.ranks,
            p.exit_code,
            meaning(p.exit_code, p.stopped),
            p.start.as_deref().unwrap_or("—"),
            p.end.as_deref().unwrap_or("—"),
            p.log.as_deref().map_or("—".to_string(), |l| format!("`{l}`")),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(study: &str, point: &str, code: i32) -> PointRecord {
        PointRecord { study: study.into(), point: point.into(), strategy: Some("ring".into()), ranks: 4, exit_code: code, stopped: false, start: None, end: None, log: Some("/s/ring-4.log".into()) }
    }

    #[test]
    fn the_last_line_of_each_point_decides() {
        let all = vec![point("a", "ring-4", 143), point("a", "ps-4", 1), point("b", "ring-4", 2), point("a", "ring-4", 0), point("a", "horovod-4", 0)];
        let failed = last_failed(all.clone(), Some("a"));
        assert_eq!(failed, vec![point("a", "ps-4", 1)]);
        let failed = last_failed(all, None);
        assert_eq!(failed.iter().map(|p| (p.study.as_str(), p.point.as_str())).collect::<Vec<_>>(), vec![("a", "ps-4"), ("b", "ring-4")]);
    }

    #[test]
    fn the_section_lists_each_failed_point() {
        let text = section(Path::new("r/points.jsonl"), &[point("a", "ps-4", 1)]);
        assert!(text.contains("1 point of the sweep"), "{text}");
        assert!(text.contains("| ps-4 | ring | 4 | 1 | error (see the log) | — | — | `/s/ring-4.log` |"), "{text}");
    }

    #[test]
    fn a_line_the_job_file_writes_parses() {
        let dir = std::env::temp_dir().join(format!("hpc-train-points-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(POINTS_FILE);
        std::fs::write(&path, concat!(
            r#"{"study":"s","point":"ring-2","strategy":"ring","ranks":2,"exit_code":3,"start":"2026-11-29T08:00:00Z","end":"2026-11-29T08:00:05Z","log":"/x/ring-2.log"}"#, "\n",
            r#"{"study":"s","point":"bench-2","ranks":2,"exit_code":0}"#, "\n",
        )).unwrap();
        let failed = failed(&path, Some("s")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!((failed[0].point.as_str(), failed[0].exit_code, failed[0].end.as_deref()), ("ring-2", 3, Some("2026-11-29T08:00:05Z")));
    }
}
