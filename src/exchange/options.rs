//! The strategies' command-line options: the groups that training and `bench` both flatten
//! into theirs ([`PsArgs`], [`HorovodArgs`], mapped onto `exchange::config`), and the check
//! that refuses an option no strategy of the run reads ([`check_strategy_options`], with the
//! options [`Given`] on the command line).

use std::path::PathBuf;

use clap::Args;

use crate::error::{Error, Result};
use crate::exchange::config::{Compression, HorovodConfig, PsConfig, PsMode, RoleOptions, StrategyKind, DEFAULT_CACHE_CAPACITY};
use crate::exchange::horovod::env_or;
use crate::optim::{LrSchedule, OptimizerConfig};

/// The options given on the command line (by clap id), apart from those left at their
/// defaults: an option that the chosen strategy never reads is refused, not silently ignored.
#[derive(Clone, Debug, Default)]
pub struct Given(std::collections::BTreeSet<String>);

impl Given {
    pub fn from_matches(matches: &clap::ArgMatches) -> Given {
        let given = |id: &&clap::Id| matches.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine);
        Given(matches.ids().filter(given).map(|id| id.as_str().to_string()).collect())
    }

    /// For tests: the given options by id.
    #[cfg(test)]
    pub fn of(ids: &[&str]) -> Given {
        Given(ids.iter().map(|s| s.to_string()).collect())
    }

    /// The same options less `ids` (a study's point that does not read them).
    pub fn without(&self, ids: &[&str]) -> Given {
        Given(self.0.iter().filter(|id| !ids.contains(&id.as_str())).cloned().collect())
    }

    pub fn has(&self, id: &str) -> bool {
        self.0.contains(id)
    }
}

/// Options that only some strategies read: (clap id, flag, the strategies that read it).
const STRATEGY_OPTIONS: &[(&str, &str, &[StrategyKind])] = {
    use StrategyKind::*;
    &[
        ("cycle_time_ms", "--cycle-time-ms", &[Horovod]),
        ("fusion_threshold_mb", "--fusion-threshold-mib", &[Horovod]),
        ("compression", "--compression", &[Horovod]),
        ("hierarchical", "--hierarchical", &[Horovod]),
        ("timeline", "--timeline", &[Horovod]),
        ("stall_warning_s", "--stall-warning-s", &[Horovod]),
        ("cache_capacity", "--cache-capacity", &[Horovod]),
        ("mpi_allreduce", "--mpi-allreduce", &[Allreduce, Horovod]),
        ("servers", "--servers", &[Ps]),
        ("ps_colocate", "--ps-colocate", &[Ps]),
        ("ps_mode", "--ps-mode", &[Ps]),
        ("max_staleness", "--max-staleness", &[Ps]),
        ("ps_timeout_s", "--ps-timeout-s", &[Ps]),
        ("cost_model", "--cost-model", &[Auto]),
    ]
};

/// Tuning options that most strategies read: one given for a run none of whose strategies reads
/// it is warned about (once, on rank 0), not refused, since scripts pass them to every run.
const TUNING_OPTIONS: &[(&str, &str, &[StrategyKind])] = {
    use StrategyKind::*;
    &[
        ("segment_kb", "--segment-kib", &[Ring, Rhd, Auto]),
        ("ring_transport", "--ring-transport", &[Ring, Auto]),
        ("bucket_mb", "--bucket-mib", &[Ring, Rhd, Auto, Allreduce, Horovod]),
    ]
};

/// Horovod's environment variables: read by Horovod-style runs only, and never a reason to
/// refuse another run (a site may export them for every job).
const HOROVOD_VARIABLES: &[&str] =
    &["HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_TIMELINE", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_CACHE_CAPACITY"];

/// Checks the options given against the strategies of the run (a study or a bench: all of its
/// strategies; an option read by one of them is fine). Returns the warnings to log once;
/// refuses an option that no strategy of the run reads, naming it and the strategies.
pub fn check_strategy_options(given: &Given, strategies: &[StrategyKind], ps: &PsArgs) -> Result<Vec<String>> {
    let names = strategies.iter().map(|s| s.name()).collect::<Vec<_>>().join(",");
    let run = if strategies.len() == 1 { format!("--strategy {names}") } else { format!("the strategies {names}") };
    let readers = |of: &[StrategyKind]| of.iter().map(|s| s.name()).collect::<Vec<_>>().join(" or ");
    for &(id, flag, of) in STRATEGY_OPTIONS {
        if given.has(id) && !strategies.iter().any(|s| of.contains(s)) {
            let what = if id == "timeline" { "writes nothing" } else { "would ignore it" };
            return Err(Error::usage(format!(
                "{flag} is an option of --strategy {}; {run} {what}: drop it, or choose that strategy",
                readers(of)
            )));
        }
    }
    if strategies.contains(&StrategyKind::Ps) {
        if given.has("max_staleness") && ps.ps_mode != PsMode::Async {
            return Err(Error::usage(
                "--max-staleness bounds asynchronous parameter servers; --ps-mode sync keeps every worker in step: drop it, or add --ps-mode async",
            ));
        }
        if given.has("servers") && ps.ps_colocate {
            return Err(Error::usage(format!(
                "--servers {} with --ps-colocate: colocated, every rank is a server; drop one of the two",
                ps.servers
            )));
        }
    }
    for var in HOROVOD_VARIABLES {
        if !strategies.contains(&StrategyKind::Horovod) && std::env::var_os(var).is_some() {
            log::debug!("{var} is set; {run} does not read it (Horovod-style runs do)");
        }
    }
    Ok(TUNING_OPTIONS
        .iter()
        .filter(|(id, _, of)| given.has(id) && !strategies.iter().any(|s| of.contains(s)))
        .map(|(_, flag, of)| format!("{flag} is read by --strategy {}; {run} ignores it", readers(of)))
        .collect())
}

/// Parameter-server options (training and bench).
#[derive(Args, Debug, Clone)]
pub struct PsArgs {
    /// Parameter-server ranks (the last ones), for --strategy ps.
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Every rank is both a worker and the server of its share of the parameters.
    #[arg(long)]
    pub ps_colocate: bool,
    /// Synchronous (average every step) or asynchronous (apply gradients as they arrive).
    #[arg(long, value_enum, default_value_t = PsMode::Sync)]
    pub ps_mode: PsMode,
    /// Asynchronous mode: rounds a worker's weights may lag behind (unbounded when not given).
    #[arg(long)]
    pub max_staleness: Option<u64>,
    /// A server reports a worker that has sent nothing for this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub ps_timeout_s: f64,
}

impl PsArgs {
    pub fn config(&self, optimizer: OptimizerConfig, schedule: LrSchedule) -> PsConfig {
        PsConfig {
            servers: self.servers,
            colocate: self.ps_colocate,
            mode: self.ps_mode,
            max_staleness: self.max_staleness,
            timeout: std::time::Duration::from_secs_f64(self.ps_timeout_s.max(0.001)),
            optimizer,
            schedule,
            checkpoint_every: None,
            first_step: 0,
        }
    }

    pub fn roles(&self) -> RoleOptions {
        RoleOptions { servers: self.servers, colocate: self.ps_colocate }
    }
}

/// Horovod-style options (training and bench). Unset flags fall back to Horovod's
/// environment variables, then to Horovod's defaults (docs/strategies.md, "Horovod's variables").
#[derive(Args, Debug, Clone)]
pub struct HorovodArgs {
    /// Background cycle, ms: tensors enqueued during a cycle are negotiated and
    /// fused at the next [env HOROVOD_CYCLE_TIME; default 1].
    #[arg(long)]
    pub cycle_time_ms: Option<f64>,
    /// Fusion buffer, MiB; 0 = no fusion [env HOROVOD_FUSION_THRESHOLD in bytes; default 128].
    #[arg(long = "fusion-threshold-mib", value_name = "MIB", aliases = ["fusion-threshold-mb"])]
    pub fusion_threshold_mb: Option<f64>,
    /// Response cache entries, least recently used evicted; 0 = no cache (every cycle
    /// negotiates through rank 0) [env HOROVOD_CACHE_CAPACITY; default 1024].
    #[arg(long)]
    pub cache_capacity: Option<usize>,
    /// Cast gradients to 16 bits for the exchange.
    #[arg(long, value_enum, default_value_t = Compression::None)]
    pub compression: Compression,
    /// Reduce within nodes, all-reduce across nodes, broadcast within nodes; ignored when every
    /// rank is on one node, as Horovod does [env HOROVOD_HIERARCHICAL_ALLREDUCE=1; horovodrun's
    /// --hierarchical-allreduce].
    #[arg(long, visible_alias = "hierarchical-allreduce", num_args = 0..=1, default_missing_value = "true")]
    pub hierarchical: Option<bool>,
    /// Stream rank 0's Horovod timeline (Chrome tracing JSON) to this file [env HOROVOD_TIMELINE;
    /// horovodrun's --timeline-filename].
    #[arg(long, visible_alias = "timeline-filename")]
    pub timeline: Option<PathBuf>,
    /// Warn about tensors that some ranks enqueued and others not, after this many seconds
    /// [env HOROVOD_STALL_CHECK_TIME_SECONDS; default 60; HOROVOD_STALL_CHECK_DISABLE=1: never].
    #[arg(long)]
    pub stall_warning_s: Option<f64>,
    /// Test hook: enqueue in a rank-dependent order, spread over cycles.
    #[arg(long, hide = true)]
    pub horovod_shuffle_enqueue: bool,
    /// Test hook RANK:SECONDS: that rank holds its last tensor back this long once.
    #[arg(long, hide = true)]
    pub horovod_test_delay: Option<String>,
}

impl HorovodArgs {
    pub fn config(&self) -> Result<HorovodConfig> {
        use std::time::Duration;
        let positive = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
        // Horovod reads its switches as integers, any value above 0 meaning on.
        let switch = |s: &str| match s {
            "true" | "True" | "TRUE" => Some(true),
            "false" | "False" | "FALSE" => Some(false),
            _ => s.parse::<i64>().ok().map(|v| v > 0),
        };
        let cycle_ms = env_or(self.cycle_time_ms, "HOROVOD_CYCLE_TIME", positive, 1.0)?;
        let fusion_mb = env_or(self.fusion_threshold_mb, "HOROVOD_FUSION_THRESHOLD", |s| positive(s).map(|b| b / (1 << 20) as f64), 128.0)?;
        let cache_capacity = env_or(self.cache_capacity, "HOROVOD_CACHE_CAPACITY", |s| s.parse::<usize>().ok(), DEFAULT_CACHE_CAPACITY)?;
        let hierarchical = env_or(self.hierarchical, "HOROVOD_HIERARCHICAL_ALLREDUCE", switch, false)?;
        let timeline = env_or(self.timeline.clone().map(Some), "HOROVOD_TIMELINE", |s| Some(Some(PathBuf::from(s))), None)?;
        if timeline.as_deref() == Some(std::path::Path::new("DYNAMIC")) {
            return Err(Error::usage(
                "HOROVOD_TIMELINE=DYNAMIC (a timeline started later from Python) is not supported: give the timeline's file name",
            ));
        }
        let timeline_mark_cycles = env_or(None, "HOROVOD_TIMELINE_MARK_CYCLES", switch, false)?;
        let stall = env_or(self.stall_warning_s, "HOROVOD_STALL_CHECK_TIME_SECONDS", positive, 60.0)?;
        let stall_check = !env_or(None, "HOROVOD_STALL_CHECK_DISABLE", switch, false)?;
        for (flag, v) in [("--cycle-time-ms", cycle_ms), ("--fusion-threshold-mib", fusion_mb), ("--stall-warning-s", stall)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::usage(format!("{flag} {v}: expected a number of 0 or more")));
            }
        }
        Ok(HorovodConfig {
            cycle_time: Duration::from_secs_f64(cycle_ms / 1e3),
            fusion_threshold: (fusion_mb * (1 << 20) as f64) as usize,
            cache_capacity,
            compression: self.compression,
            hierarchical,
            timeline,
            timeline_mark_cycles,
            stall_check,
            stall_warning: Duration::from_secs_f64(stall),
            shuffle_enqueue: self.horovod_shuffle_enqueue,
            test_delay: match &self.horovod_test_delay {
                None => None,
                Some(spec) => {
                    let parsed = spec.split_once(':').and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<f64>().ok()?)));
                    let (rank, secs) = parsed.ok_or_else(|| Error::usage(format!("--horovod-test-delay {spec:?}: expected RANK:SECONDS")))?;
                    Some((rank, Duration::from_secs_f64(secs)))
                }
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ps(mode: PsMode, colocate: bool) -> PsArgs {
        PsArgs { servers: 1, ps_colocate: colocate, ps_mode: mode, max_staleness: None, ps_timeout_s: 600.0 }
    }

    #[test]
    fn options_no_strategy_of_the_run_reads_are_refused() {
        use PsMode::{Async, Sync};
        use StrategyKind::*;
        let check = |ids: &[&str], strategies: &[StrategyKind], ps: PsArgs| check_strategy_options(&Given::of(ids), strategies, &ps);
        let refused = |ids: &[&str], strategies: &[StrategyKind], ps: PsArgs| check(ids, strategies, ps).unwrap_err().to_string();
        assert!(refused(&["timeline"], &[Ring], ps(Sync, false)).contains("--timeline is an option of --strategy horovod; --strategy ring writes nothing"));
        for (id, flag) in [("compression", "--compression"), ("hierarchical", "--hierarchical"), ("cycle_time_ms", "--cycle-time-ms"), ("fusion_threshold_mb", "--fusion-threshold-mib")] {
            assert!(refused(&[id], &[Allreduce], ps(Sync, false)).starts_with(&format!("{flag} is an option of --strategy horovod")));
        }
        for id in ["servers", "ps_mode", "ps_colocate", "max_staleness", "ps_timeout_s"] {
            assert!(refused(&[id], &[Ring], ps(Sync, false)).contains("--strategy ring would ignore it"), "{id}");
        }
        assert!(refused(&["cost_model"], &[Ring, Rhd], ps(Sync, false)).contains("the strategies ring,rhd would ignore it"));
        assert!(refused(&["max_staleness"], &[Ps], ps(Sync, false)).contains("--ps-mode sync"));
        assert!(refused(&["servers"], &[Ps], ps(Sync, true)).contains("with --ps-colocate"));
        // Used by one strategy of a study: fine.
        assert!(check(&["timeline", "servers"], &[Ring, Horovod, Ps], ps(Sync, false)).unwrap().is_empty());
        assert!(check(&["max_staleness", "ps_mode"], &[Ps], ps(Async, false)).unwrap().is_empty());
        // Tuning options: a warning.
        let warnings = check(&["segment_kb", "bucket_mb"], &[Ps], ps(Sync, false)).unwrap();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(check(&["segment_kb", "ring_transport"], &[Auto], ps(Sync, false)).unwrap().is_empty());
    }
}
