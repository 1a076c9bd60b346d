//! What combines: every option that changes what a step computes or how it fails, against
//! every kind of layout, as data. A pair is supported (and then a run with it must equal the
//! plain run: tests/conformance.rs walks the table), refused with the reason, or not
//! applicable (the option belongs to another layout, which the run must also have).
//!
//! A run is in several kinds at once (a ring exchange among the replicas of a 1F1B pipeline of
//! tensor-parallel groups is in `ring`, `1f1b`, `tensor-parallel` and `tp+pipeline`): each of
//! its options must be supported in every kind it is in, and each of its kinds in every other
//! (the layout rows). train/plan.rs refuses from this table and from nowhere else; docs/combinations.md's
//! compatibility table and `hpc-train compat` are printed from it.
//!
//! Size checks (a power of two of ranks for ZeRO with rhd, micro-batches against the batch,
//! heads against T) are not combinations of options and stay beside the plan that needs them.

use std::fmt::Write as _;

/// A kind of layout: one axis of how a run is laid out over its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Ring,
    Rhd,
    Auto,
    /// Parameter servers, synchronous.
    Ps,
    /// Parameter servers, asynchronous (bounded or unbounded staleness).
    PsAsync,
    Allreduce,
    Horovod,
    Zero1,
    Zero2,
    Zero3,
    /// `--zero 3 --fsdp-hybrid`: sharded within nodes, replicated across them.
    Zero3Hybrid,
    Gpipe,
    OneFOneB,
    Interleaved,
    /// Zero-bubble schedules: backward split into B and W.
    ZbH1,
    ZbV,
    TensorParallel,
    /// Tensor-parallel groups as the stages of a pipeline (D x P x T with P, T > 1).
    TensorPipeline,
}

impl Kind {
    pub const ALL: [Kind; 18] = [
        Kind::Ring,
        Kind::Rhd,
        Kind::Auto,
        Kind::Ps,
        Kind::PsAsync,
        Kind::Allreduce,
        Kind::Horovod,
        Kind::Zero1,
        Kind::Zero2,
        Kind::Zero3,
        Kind::Zero3Hybrid,
        Kind::Gpipe,
        Kind::OneFOneB,
        Kind::Interleaved,
        Kind::ZbH1,
        Kind::ZbV,
        Kind::TensorParallel,
        Kind::TensorPipeline,
    ];

    /// The column's name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Ring => "ring",
            Kind::Rhd => "rhd",
            Kind::Auto => "auto",
            Kind::Ps => "ps",
            Kind::PsAsync => "ps async",
            Kind::Allreduce => "allreduce",
            Kind::Horovod => "horovod",
            Kind::Zero1 => "zero 1",
            Kind::Zero2 => "zero 2",
            Kind::Zero3 => "zero 3",
            Kind::Zero3Hybrid => "fsdp-hybrid",
            Kind::Gpipe => "gpipe",
            Kind::OneFOneB => "1f1b",
            Kind::Interleaved => "interleaved",
            Kind::ZbH1 => "zb-h1",
            Kind::ZbV => "zb-v",
            Kind::TensorParallel => "tensor-parallel",
            Kind::TensorPipeline => "tp+pipeline",
        }
    }

    /// How a command line asks for it (for messages).
    pub fn flag(self) -> &'static str {
        match self {
            Kind::Ring => "--strategy ring",
            Kind::Rhd => "--strategy rhd",
            Kind::Auto => "--strategy auto",
            Kind::Ps => "--strategy ps",
            Kind::PsAsync => "--strategy ps --ps-mode async",
            Kind::Allreduce => "--strategy allreduce",
            Kind::Horovod => "--strategy horovod",
            Kind::Zero1 => "--zero 1",
            Kind::Zero2 => "--zero 2",
            Kind::Zero3 => "--zero 3",
            Kind::Zero3Hybrid => "--fsdp-hybrid",
            Kind::Gpipe => "--pipeline-stages (--schedule gpipe)",
            Kind::OneFOneB => "--pipeline-stages (--schedule 1f1b)",
            Kind::Interleaved => "--pipeline-stages (--schedule interleaved)",
            Kind::ZbH1 => "--pipeline-stages (--schedule zb-h1)",
            Kind::ZbV => "--pipeline-stages (--schedule zb-v)",
            Kind::TensorParallel => "--tensor-parallel",
            Kind::TensorPipeline => "--tensor-parallel and --pipeline-stages",
        }
    }

    fn is_pipeline(self) -> bool {
        matches!(self, Kind::Gpipe | Kind::OneFOneB | Kind::Interleaved | Kind::ZbH1 | Kind::ZbV | Kind::TensorPipeline)
    }

    fn is_sharded(self) -> bool {
        matches!(self, Kind::Zero1 | Kind::Zero2 | Kind::Zero3 | Kind::Zero3Hybrid)
    }

    fn is_parameter_server(self) -> bool {
        matches!(self, Kind::Ps | Kind::PsAsync)
    }
}

/// An option a run may use, as a row of the table: what it changes in a step or in how a step
/// fails. Layout kinds are rows too (`Layout`), for the pairs of kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    Tf32,
    Bf16,
    Fp16,
    Lars,
    Adamw,
    /// A learning-rate schedule other than constant (warm-up, step, cosine, poly), or scaling.
    LrSchedule,
    LabelSmoothing,
    /// `--overlap on`, asked for explicitly (`auto` turns it on only where a layout has it).
    Overlap,
    ChannelsLast,
    Recompute,
    Checkpoint,
    Resume,
    SaveWeights,
    InitWeights,
    Eval,
    /// `HPC_TRAIN_FAULT`'s injected faults, and the watchdog that must end a run they stall.
    Faults,
    Profile,
    PipelineTimeline,
    HorovodTimeline,
    Compression,
    Hierarchical,
    CacheData,
    StrongScaling,
    Layout(Kind),
}

impl Feature {
    /// The rows of the table, in order.
    pub fn rows() -> Vec<Feature> {
        let mut rows = vec![
            Feature::Tf32,
            Feature::Bf16,
            Feature::Fp16,
            Feature::Lars,
            Feature::Adamw,
            Feature::LrSchedule,
            Feature::LabelSmoothing,
            Feature::Overlap,
            Feature::ChannelsLast,
            Feature::Recompute,
            Feature::Checkpoint,
            Feature::Resume,
            Feature::SaveWeights,
            Feature::InitWeights,
            Feature::Eval,
            Feature::Faults,
            Feature::Profile,
            Feature::PipelineTimeline,
            Feature::HorovodTimeline,
            Feature::Compression,
            Feature::Hierarchical,
            Feature::CacheData,
            Feature::StrongScaling,
        ];
        rows.extend(Kind::ALL.iter().map(|&k| Feature::Layout(k)));
        rows
    }

    /// How a command line asks for it (the row's name, and the messages').
    pub fn flag(self) -> &'static str {
        match self {
            Feature::Tf32 => "--precision tf32",
            Feature::Bf16 => "--precision bf16",
            Feature::Fp16 => "--precision fp16",
            Feature::Lars => "--optimizer lars",
            Feature::Adamw => "--optimizer adamw",
            Feature::LrSchedule => "--lr-schedule/--warmup-epochs/--scale-lr",
            Feature::LabelSmoothing => "--label-smoothing",
            Feature::Overlap => "--overlap on",
            Feature::ChannelsLast => "--channels-last",
            Feature::Recompute => "--recompute",
            Feature::Checkpoint => "--checkpoint-dir",
            Feature::Resume => "--resume",
            Feature::SaveWeights => "--save-weights",
            Feature::InitWeights => "--init-weights",
            Feature::Eval => "evaluation (without --no-eval)",
            Feature::Faults => "HPC_TRAIN_FAULT",
            Feature::Profile => "--profile-dir",
            Feature::PipelineTimeline => "--pipeline-timeline",
            Feature::HorovodTimeline => "--timeline",
            Feature::Compression => "--compression",
            Feature::Hierarchical => "--hierarchical",
            Feature::CacheData => "--cache-data on",
            Feature::StrongScaling => "--scaling strong",
            Feature::Layout(k) => k.flag(),
        }
    }

    /// The layout kinds without which the option means nothing (empty: it means something in
    /// every kind). A run must be in one of them.
    pub fn needs(self) -> &'static [Kind] {
        match self {
            Feature::Recompute | Feature::PipelineTimeline => &[Kind::Gpipe, Kind::OneFOneB, Kind::Interleaved, Kind::ZbH1, Kind::ZbV],
            Feature::HorovodTimeline | Feature::Compression | Feature::Hierarchical => &[Kind::Horovod],
            Feature::Layout(Kind::Zero3Hybrid) => &[Kind::Zero3],
            Feature::Layout(Kind::TensorPipeline) => &[Kind::TensorParallel],
            _ => &[],
        }
    }
}

/// A cell of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Works, and gives the plain run's result.
    Supported,
    /// Refused before anything starts, for this reason.
    Refused(&'static str),
    /// The option belongs to other kinds (see [`Feature::needs`]), or the row is the column.
    NotApplicable,
}

const FP16_PS: &str = "the loss scaler unscales gradients before the optimizer step, which the servers own; use bf16";
const ASYNC_NOT_SGD: &str =
    "asynchronous servers split SGD's update over the gradients as they arrive, which only SGD's linear update allows; use --ps-mode sync";
const OVERLAP_PS: &str = "the parameter servers take whole shares after backward; use --overlap off or auto";
const OVERLAP_SPLIT: &str = "a split backward makes each chunk's weight gradients in W passes from graphs kept since its B, which overlap does not run beside the exchange; use --overlap off or auto, or --schedule gpipe, 1f1b or interleaved";
const OVERLAP_TENSOR: &str =
    "the data-parallel exchange runs after backward, whose own all-reduces run on the run's thread; use --overlap off or auto";
const RECOMPUTE_SPLIT: &str = "a split backward keeps the forward's graph from its B to its W, which recomputation exists not to keep; use --schedule 1f1b or interleaved with --recompute";
const ZERO_STRATEGY: &str = "ZeRO shards the optimizer (and at stage 3 the parameters) along a reduce-scatter and an all-gather, which only the from-scratch all-reduces (ring, rhd, auto) run apart";
const PS_PIPELINE: &str = "a pipeline's stages average their gradients among themselves; use ring, rhd, auto, allreduce or horovod";
const PS_TENSOR: &str = "parameter servers take ranks out of the groups; use ring, rhd, auto, allreduce or horovod";
const CHECKPOINT_ASYNC: &str = "asynchronous servers hold no state consistent across ranks at any step; checkpoint a synchronous run";

/// The verdict for option `feature` in a run of layout kind `kind`.
pub fn verdict(feature: Feature, kind: Kind) -> Verdict {
    use Verdict::{NotApplicable as Na, Refused, Supported};
    let needs = feature.needs();
    if !needs.is_empty() && !needs.contains(&kind) {
        // An option of pipelines is supported in a tp+pipeline run through its schedule's
        // column; the same for the other kinds that need a companion.
        return Na;
    }
    match (feature, kind) {
        (Feature::Fp16, k) if k.is_parameter_server() => Refused(FP16_PS),
        (Feature::Lars | Feature::Adamw, Kind::PsAsync) => Refused(ASYNC_NOT_SGD),
        (Feature::Overlap, k) if k.is_parameter_server() => Refused(OVERLAP_PS),
        (Feature::Overlap, Kind::ZbH1 | Kind::ZbV) => Refused(OVERLAP_SPLIT),
        (Feature::Overlap, Kind::TensorParallel | Kind::TensorPipeline) => Refused(OVERLAP_TENSOR),
        (Feature::Recompute, Kind::ZbH1 | Kind::ZbV) => Refused(RECOMPUTE_SPLIT),
        (Feature::Checkpoint | Feature::Resume, Kind::PsAsync) => Refused(CHECKPOINT_ASYNC),
        (Feature::Layout(a), b) => pair(a, b),
        _ => Supported,
    }
}

/// Two kinds of layout in one run. The relation is symmetric: either order gives the verdict.
fn pair(a: Kind, b: Kind) -> Verdict {
    use Verdict::{NotApplicable as Na, Refused, Supported};
    if a == b {
        return Na;
    }
    let (a, b) = (a.min(b), a.max(b));
    let strategy = |k: Kind| k <= Kind::Horovod;
    match (a, b) {
        // One strategy per run.
        (a, b) if strategy(a) && strategy(b) => Na,
        // One ZeRO stage per run; hybrid is stage 3's variant, and needs it.
        (Kind::Zero3, Kind::Zero3Hybrid) => Supported,
        (a, b) if a.is_sharded() && b.is_sharded() => Na,
        // One schedule per pipeline; tp+pipeline is a pipeline of any schedule.
        (a, Kind::TensorPipeline) if a.is_pipeline() => Supported,
        (a, b) if a.is_pipeline() && b.is_pipeline() => Na,
        (Kind::TensorParallel, Kind::TensorPipeline) => Supported,
        (a, Kind::TensorPipeline) if a.is_parameter_server() => Refused(PS_TENSOR),
        (_, Kind::TensorPipeline) => Supported,
        (a, b) if a.is_parameter_server() && b.is_sharded() => Refused(ZERO_STRATEGY),
        (Kind::Allreduce | Kind::Horovod, b) if b.is_sharded() => Refused(ZERO_STRATEGY),
        (a, b) if a.is_parameter_server() && b.is_pipeline() => Refused(PS_PIPELINE),
        (a, Kind::TensorParallel) if a.is_parameter_server() => Refused(PS_TENSOR),
        _ => Supported,
    }
}

/// The first refused pair among a run's options and kinds, as the message that names both;
/// or an option that needs a kind the run is not in.
pub fn check(features: &[Feature], kinds: &[Kind]) -> Result<(), String> {
    for &feature in features {
        let needs = feature.needs();
        if !needs.is_empty() && !kinds.iter().any(|k| needs.contains(k)) {
            let names: Vec<&str> = needs.iter().map(|k| k.flag()).collect();
            return Err(format!("{} is an option of {}; this run has none: drop it, or add one", feature.flag(), names.join(" or ")));
        }
        for &kind in kinds {
            if let Verdict::Refused(why) = verdict(feature, kind) {
                return Err(format!("{} with {}: {why}", feature.flag(), kind.flag()));
            }
        }
    }
    for (i, &a) in kinds.iter().enumerate() {
        for &b in &kinds[i + 1..] {
            if let Verdict::Refused(why) = pair(a, b) {
                return Err(format!("{} with {}: {why}", a.flag(), b.flag()));
            }
        }
    }
    Ok(())
}

/// How many pairs the table holds of each verdict: (supported, refused, not applicable).
pub fn counts() -> (usize, usize, usize) {
    let mut counts = (0, 0, 0);
    for feature in Feature::rows() {
        for kind in Kind::ALL {
            match verdict(feature, kind) {
                Verdict::Supported => counts.0 += 1,
                Verdict::Refused(_) => counts.1 += 1,
                Verdict::NotApplicable => counts.2 += 1,
            }
        }
    }
    counts
}

/// The table in Markdown: a row per option, a column per kind, the reasons numbered below it.
/// docs/combinations.md's table is this text (a unit test compares them).
pub fn markdown() -> String {
    let mut reasons: Vec<&'static str> = Vec::new();
    let mut out = String::new();
    let header: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
    let _ = writeln!(out, "| option | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(Kind::ALL.len()));
    for feature in Feature::rows() {
        let cells: Vec<String> = Kind::ALL
            .iter()
            .map(|&kind| match verdict(feature, kind) {
                Verdict::Supported => "yes".to_string(),
                Verdict::NotApplicable => "·".to_string(),
                Verdict::Refused(why) => {
                    let n = match reasons.iter().position(|r| *r == why) {
                        Some(i) => i + 1,
                        None => {
                            reasons.push(why);
                            reasons.len()
                        }
                    };
                    format!("no ({n})")
                }
            })
            .collect();
        let _ = writeln!(out, "| `{}` | {} |", feature.flag(), cells.join(" | "));
    }
    let (supported, refused, na) = counts();
    let _ = writeln!(out);
    let _ = writeln!(out, "{supported} pairs supported, {refused} refused, {na} not applicable (`·`: the option belongs to another layout kind, which the run must also have, or the row is the column). Refused, with the reason the run prints:");
    let _ = writeln!(out);
    for (i, why) in reasons.iter().enumerate() {
        let _ = writeln!(out, "{}. {why}", i + 1);
    }
    out
}

/// Every pair, one per line, tab-separated: the row (an option's flag, or `layout:` and a
/// kind's name), the row's flag, the column (a kind's name), the column's flag, `yes`, `no` or
/// `n/a`, and the reason of a refusal. tests/conformance.rs builds its runs from it.
pub fn tsv() -> String {
    let mut out = String::new();
    for feature in Feature::rows() {
        let row = match feature {
            Feature::Layout(k) => format!("layout:{}", k.name()),
            other => other.flag().to_string(),
        };
        for kind in Kind::ALL {
            let (verdict, why) = match verdict(feature, kind) {
                Verdict::Supported => ("yes", ""),
                Verdict::Refused(why) => ("no", why),
                Verdict::NotApplicable => ("n/a", ""),
            };
            let _ = writeln!(out, "{row}\t{}\t{}\t{}\t{verdict}\t{why}", feature.flag(), kind.name(), kind.flag());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_of_kinds_are_symmetric() {
        for a in Kind::ALL {
            for b in Kind::ALL {
                assert_eq!(pair(a, b), pair(b, a), "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn the_known_refusals_are_in_the_table() {
        assert!(matches!(verdict(Feature::Fp16, Kind::Ps), Verdict::Refused(_)));
        assert_eq!(verdict(Feature::Fp16, Kind::Zero3), Verdict::Supported);
        // Stage 3 shards a pipeline stage's parameters over its replicas (train/pipeline_step.rs).
        assert_eq!(verdict(Feature::Layout(Kind::Zero3), Kind::OneFOneB), Verdict::Supported);
        assert_eq!(verdict(Feature::Layout(Kind::Zero3), Kind::ZbV), Verdict::Supported);
        assert_eq!(pair(Kind::Zero3Hybrid, Kind::ZbV), Verdict::Supported);
        // ZeRO shards a tensor-parallel rank's parts over the ranks that hold the same part.
        assert_eq!(verdict(Feature::Layout(Kind::TensorParallel), Kind::Zero1), Verdict::Supported);
        assert_eq!(verdict(Feature::Layout(Kind::TensorParallel), Kind::Zero3Hybrid), Verdict::Supported);
        assert_eq!(verdict(Feature::Layout(Kind::Zero2), Kind::TensorPipeline), Verdict::Supported);
        assert_eq!(verdict(Feature::Layout(Kind::Zero3), Kind::TensorPipeline), Verdict::Supported);
        assert!(matches!(verdict(Feature::Layout(Kind::Ps), Kind::Gpipe), Verdict::Refused(_)));
        assert!(matches!(verdict(Feature::Layout(Kind::Horovod), Kind::Zero1), Verdict::Refused(_)));
        // Sharded checkpoints write pipelines of groups as well (issue 49).
        assert_eq!(verdict(Feature::Checkpoint, Kind::TensorPipeline), Verdict::Supported);
        assert_eq!(verdict(Feature::Bf16, Kind::OneFOneB), Verdict::Supported);
        assert_eq!(verdict(Feature::Layout(Kind::Zero1), Kind::Gpipe), Verdict::Supported);
        assert_eq!(verdict(Feature::Recompute, Kind::Ring), Verdict::NotApplicable);
        assert_eq!(verdict(Feature::Recompute, Kind::Interleaved), Verdict::Supported);
        // Stage 3 installs each 4-d parameter channels-last (exchange/fsdp.rs), as FSDP2 keeps
        // each parameter's memory format.
        assert_eq!(verdict(Feature::ChannelsLast, Kind::Zero3), Verdict::Supported);
        assert_eq!(verdict(Feature::ChannelsLast, Kind::Zero3Hybrid), Verdict::Supported);
    }

    #[test]
    fn a_run_is_checked_in_every_kind_it_is_in() {
        // ring among the replicas of a ZB-H1 pipeline: overlap refused through the schedule,
        // and allowed through the unsplit schedules.
        let err = check(&[Feature::Overlap], &[Kind::Ring, Kind::ZbH1]).unwrap_err();
        assert!(err.starts_with("--overlap on with --pipeline-stages (--schedule zb-h1):"), "{err}");
        assert!(check(&[Feature::Overlap], &[Kind::Ring, Kind::Zero1, Kind::Interleaved]).is_ok());
        // fp16 combines with ZeRO and pipelines, and is refused through the parameter server.
        assert!(check(&[Feature::Fp16], &[Kind::Ring, Kind::Zero1, Kind::OneFOneB]).is_ok());
        let err = check(&[Feature::Fp16], &[Kind::Ps]).unwrap_err();
        assert!(err.starts_with("--precision fp16 with --strategy ps:"), "{err}");
        assert!(check(&[Feature::Fp16], &[Kind::Ring, Kind::Zero3, Kind::Gpipe]).is_ok());
        let err = check(&[Feature::Recompute], &[Kind::Ring]).unwrap_err();
        assert!(err.starts_with("--recompute is an option of --pipeline-stages (--schedule gpipe) or"), "{err}");
        assert!(check(&[Feature::Bf16, Feature::Lars, Feature::Recompute], &[Kind::Ring, Kind::Zero1, Kind::Interleaved]).is_ok());
    }

    #[test]
    fn the_combinations_page_shows_this_table() {
        let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/combinations.md")).unwrap();
        let (begin, end) = ("<!-- compat:begin (hpc-train compat) -->\n", "<!-- compat:end -->");
        let start = page.find(begin).expect("docs/combinations.md has the compatibility table's markers") + begin.len();
        let stop = page[start..].find(end).expect("the end marker") + start;
        assert_eq!(&page[start..stop], markdown(), "docs/combinations.md's table differs from the table in src/plan/compat.rs: run scripts/compat-table.sh");
    }
}
