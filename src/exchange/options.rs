//! The strategies' command-line options: the groups that training and `bench` both flatten
//! into theirs, each option declared once with one help text and one default ([`ExchangeArgs`],
//! [`WatchdogArgs`], [`PsArgs`], [`HorovodArgs`], mapped onto `exchange::config`), and the check
//! that refuses an option no strategy of the run reads ([`check_strategy_options`], with the
//! options [`Given`] on the command line).

use std::path::PathBuf;

use clap::Args;

use crate::error::{Error, Result};
use crate::exchange::config::{Compression, CudaAware, HorovodConfig, MpiAllreduceCall, PsConfig, PsMode, RingTransport, RoleOptions, StrategyKind, DEFAULT_CACHE_CAPACITY};
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

/// Options of the exchange that most strategies read (training and bench). Their help heading
/// is the flattening command's (training's "Exchange" is also the run file's `[exchange]`).
#[derive(Args, Debug, Clone)]
pub struct ExchangeArgs {
    /// Gradient bucket size, MiB: tensors are fused into buckets of about this size, each
    /// exchanged as one message (in the bench, the multi-tensor layouts' tensors); 0 = one
    /// exchange per tensor (the naive variant).
    #[arg(long = "bucket-mib", value_name = "MIB", aliases = ["bucket-mb"], default_value_t = 25.0)]
    pub bucket_mb: f64,

    /// Ring all-reduce segment size, KiB (the pipelining grain of the ring; the default is the
    /// best measured in results/strategies/README.md).
    #[arg(long = "segment-kib", value_name = "KIB", aliases = ["segment-kb"], default_value_t = 4096)]
    pub segment_kb: u64,

    /// How the ring's ranks reach each other: `auto` reads and adds a neighbour's chunk straight
    /// from node-shared memory when every rank is on one node, and sends MPI messages otherwise.
    #[arg(long, value_enum, default_value_t = RingTransport::Auto)]
    pub ring_transport: RingTransport,

    /// The MPI call of `allreduce` and `horovod` on host buffers: `blocking` (MPI_Allreduce, as
    /// users and Horovod call it) or `nonblocking` (MPI_Iallreduce and a polling wait, the
    /// call hpc-train's earlier versions made, for comparison). Device buffers always take the
    /// blocking call.
    #[arg(long, value_enum, default_value_t = MpiAllreduceCall::Blocking)]
    pub mpi_allreduce: MpiAllreduceCall,

    /// Whether the MPI library can read GPU memory; auto asks it (MPIX_GPU_query_support,
    /// MPIX_Query_cuda_support or MVAPICH2's MV2_USE_CUDA; none answering: no).
    #[arg(long, value_enum, default_value_t = CudaAware::Auto)]
    pub cuda_aware: CudaAware,

    /// Cost model (JSON, from `hpc-train model fit`) with which `--strategy auto` picks ring,
    /// rhd or recursive doubling per bucket [default: built-in link costs].
    #[arg(long)]
    pub cost_model: Option<PathBuf>,
}

impl ExchangeArgs {
    /// Refuses values that no exchange can use (clap checks the types, not the ranges).
    pub fn check(&self) -> Result<()> {
        if self.bucket_mb < 0.0 || !self.bucket_mb.is_finite() {
            return Err(Error::usage(format!("--bucket-mib {}: expected 0 or more", self.bucket_mb)));
        }
        Ok(())
    }

    /// `--bucket-mib` in bytes.
    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_mb * (1 << 20) as f64) as usize
    }

    /// `--segment-kib` in bytes.
    pub fn segment_bytes(&self) -> usize {
        (self.segment_kb as usize) << 10
    }
}

/// The exchange watchdog's default: far beyond any one exchange on a working cluster (a 100 MB
/// bucket over a 1 Gbit/s link takes about a second; the first exchange may also set up
/// connections), and far below a batch job's time limit.
pub const DEFAULT_EXCHANGE_TIMEOUT_S: f64 = 300.0;

/// The watchdog over exchanges (training and bench): a group of its own because its help
/// heading differs, training's being "Checkpoints and faults" (the run file's `[checkpoint]`,
/// since it also bounds checkpoint writes) and the bench's "Exchange".
#[derive(Args, Debug, Clone)]
pub struct WatchdogArgs {
    /// Abort the job when an exchange, or a collective between exchanges, makes no progress for
    /// this many seconds (a cut link or a dead node), after every rank logs what it waits for;
    /// in training, a checkpoint write longer than this (the slowest rank's part of a sharded
    /// one, rank 0's whole one) aborts the job too, the previous checkpoint kept: keep it above
    /// the longest write; 0: off.
    #[arg(long, default_value_t = DEFAULT_EXCHANGE_TIMEOUT_S)]
    pub exchange_timeout_s: f64,
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

    /// Training's check and the bench's are this one: a negative or infinite bucket size is
    /// refused (the bench used to take it as 0, one exchange per tensor).
    #[test]
    fn a_bucket_size_below_zero_is_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            exchange: ExchangeArgs,
        }
        let check = |mib: &str| Command::try_parse_from(["x", &format!("--bucket-mib={mib}")]).unwrap().exchange.check().map_err(|e| e.to_string());
        assert_eq!(check("-1").unwrap_err(), "--bucket-mib -1: expected 0 or more");
        assert!(check("inf").unwrap_err().starts_with("--bucket-mib inf"));
        assert!(check("0").is_ok() && check("0.5").is_ok());
        let args = Command::try_parse_from(["x", "--bucket-mb", "0.5", "--segment-kb", "8"]).unwrap().exchange;
        assert_eq!((args.bucket_bytes(), args.segment_bytes()), (1 << 19, 8192));
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
