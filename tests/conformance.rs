//! The conformance matrix, generated from the compatibility table (src/plan/compat.rs, as
//! `hpc-train compat --tsv` prints it): every supported pair of an option and a layout kind
//! trains a few steps of a tiny model and must equal the plain run (one process with the same
//! option) within f32 summation tolerance, weights and the record's loss alike; every refused
//! pair must be refused before anything starts with the table's reason, naming both options.
//! Each unordered pair of layout kinds runs once (the table lists it both ways), and the options
//! that only the optimizer reads train against one layout kind of each family of optimizer
//! steps ([`optimizer_family`]); every refused pair is refused.
//! The tiny CNN has no batch norm, so the pairs whose options or layouts touch the forward
//! (recomputation, pipelines, stage 3's units, a resume from a checkpoint) also train ResNet-18,
//! against data parallelism over the same replicas and micro-batches ([`batch_norm_cell`]).
//!
//! The runs go through `hpc-train conform`, which runs them one after another inside one launch
//! (one MPI start-up for a few hundred runs). A row or a column this test does not know fails
//! it: a new option or layout kind in the table must say here how it is exercised.
//! A few refused pairs are also launched as runs of their own, to see one line and every rank
//! exit non-zero as a user does.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

/// One pair of the table.
struct Cell {
    row: String,
    row_flag: String,
    column: String,
    column_flag: String,
    verdict: String,
    why: String,
}

fn table() -> Vec<Cell> {
    let out = hpc_train(&["compat", "--tsv"]).expect_ok().stdout;
    out.lines()
        .map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            assert_eq!(f.len(), 6, "{line:?}");
            Cell { row: f[0].into(), row_flag: f[1].into(), column: f[2].into(), column_flag: f[3].into(), verdict: f[4].into(), why: f[5].into() }
        })
        .collect()
}

/// A run's layout, built up from the table's kinds.
#[derive(Clone, Default, Debug)]
struct Layout {
    strategy: Option<&'static str>,
    ps_async: bool,
    zero: Option<&'static str>,
    hybrid: bool,
    schedule: Option<&'static str>,
    tensor: bool,
}

impl Layout {
    fn with(mut self, kind: &str) -> Layout {
        match kind {
            "ring" | "rhd" | "auto" | "allreduce" | "horovod" | "ps" => self.strategy = Some(leak(kind)),
            "ps async" => {
                self.strategy = Some("ps");
                self.ps_async = true;
            }
            "zero 1" => self.zero = Some("1"),
            "zero 2" => self.zero = Some("2"),
            "zero 3" => self.zero = Some("3"),
            "fsdp-hybrid" => {
                self.zero = Some("3");
                self.hybrid = true;
            }
            "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zb-v" => self.schedule = Some(leak(kind)),
            "tensor-parallel" => self.tensor = true,
            "tp+pipeline" => {
                self.tensor = true;
                self.schedule.get_or_insert("1f1b");
            }
            other => panic!("the table has a layout kind {other:?} that tests/conformance.rs does not know: say here how to lay a run out so"),
        }
        self
    }

    /// Replicas: two where the run names a data-parallel kind, else one (a pipeline or a
    /// tensor-parallel group alone).
    fn replicas(&self) -> usize {
        if self.strategy.is_some() || self.zero.is_some() { 2 } else { 1 }
    }

    fn ranks(&self) -> usize {
        match (self.strategy, self.ps_async) {
            // Synchronous servers: one server and two workers. Asynchronous ones with a single
            // worker, whose updates then come in the plain run's order.
            (Some("ps"), false) => 3,
            (Some("ps"), true) => 2,
            _ => self.replicas() * if self.schedule.is_some() { 2 } else { 1 } * if self.tensor { 2 } else { 1 },
        }
    }

    fn model(&self) -> &'static str {
        if self.tensor { "vit-tiny" } else { "tiny" }
    }

    fn args(&self) -> Vec<String> {
        let mut a: Vec<&str> = vec!["--strategy", self.strategy.unwrap_or("ring")];
        if self.ps_async {
            a.extend(["--ps-mode", "async"]);
        }
        if let Some(z) = self.zero {
            a.extend(["--zero", z]);
        }
        if self.hybrid {
            a.push("--fsdp-hybrid");
        }
        if let Some(s) = self.schedule {
            a.extend(["--pipeline-stages", "2", "--micro-batches", MICRO_BATCHES, "--schedule", s, "--partition", "params"]);
            if s == "interleaved" {
                a.extend(["--virtual-stages", "2"]);
            }
        }
        if self.tensor {
            a.extend(["--tensor-parallel", "2"]);
        }
        a.into_iter().map(String::from).collect()
    }
}

/// How a row of the table is exercised.
enum Row {
    /// Options added to the run (and to its plain reference unless `plain_reference`).
    Options { args: Vec<String>, plain_reference: bool, tolerance: f64 },
    /// Another layout kind combined with the column's.
    Layout(String),
    /// Trained in two runs, the second resuming from the first's checkpoint.
    Resume,
    /// Needs what this machine lacks.
    Skip(&'static str),
    /// Tested by its own test (`faults_end_every_layout_kind`).
    Elsewhere,
}

const F32_TOLERANCE: f64 = 2e-5;
/// The most ranks a matrix run takes under MPICH (see its use).
const MPICH_MOST_RANKS: usize = 4;
/// The columns an option row trains against under MPICH: one of each family of exchange
/// (hpc-train's own ring, MPI_Allreduce, the parameter server's messages, the sharded units'
/// gathers, a pipeline's sends, tensor parallelism's all-reduces). What an option does to a
/// layout does not depend on the MPI library, and Open MPI's run trains every pair; MPICH's
/// run still trains every pair of layouts, and refuses every refused pair.
const MPICH_OPTION_COLUMNS: [&str; 6] = ["ring", "allreduce", "ps", "zero 3", "1f1b", "tensor-parallel"];
/// The rows that only the optimizer reads: what they change is the update computed from a
/// step's averaged gradients (LARS's trust ratios, AdamW's moments, the learning rate of each
/// step). The gradients a layout hands its optimizer are what the other rows compare against
/// the plain run in every column; what a layout changes in the update itself is where it steps
/// the optimizer and over what, and the columns of one family below share that code. So these
/// rows train against one column of each family ([`optimizer_family`]); their refused cells are
/// all kept (a refusal costs no training).
const OPTIMIZER_ONLY_ROWS: [&str; 3] = ["--optimizer lars", "--optimizer adamw", "--lr-schedule/--warmup-epochs/--scale-lr"];

/// The column of `column`'s family that the optimizer-only rows train against (of the columns
/// MPICH's run trains, [`MPICH_OPTION_COLUMNS`], where the family has one), by where the family
/// steps its optimizer:
/// - ring, rhd, auto, allreduce, horovod: `Strategy::update`'s default, the mean of the
///   gradients and then `Optimizer::step` over whole tensors on every rank (only the mean's
///   messages differ, and every other row trains them all);
/// - ps: the synchronous servers' `step_pieces` over their share; ps async: each gradient as
///   it arrives (a column of its own: LARS and AdamW are refused there, the schedule is not);
/// - zero 1, zero 2: exchange/zero.rs's `step_pieces` over a bucket's shard, LARS's norms
///   summed over the ranks (stage 2 differs in when it lets go of the full gradients, before
///   the same step);
/// - zero 3, fsdp-hybrid: exchange/fsdp.rs's `step_pieces` over a unit's shard (the hybrid
///   run sums over the node's shards, one node here);
/// - the five schedules: the stage's parameters through the run's strategy after the schedule
///   (src/train/pipeline_step.rs, one for all schedules), whole layers per stage;
/// - tensor-parallel, tp+pipeline: `Optimizer::step` with LARS's per-layer figures summed
///   over the group's parts (train/tensor.rs's `layer_parts`, by name, whatever the stage).
fn optimizer_family(column: &str) -> &'static str {
    match column {
        "ring" | "rhd" | "auto" | "allreduce" | "horovod" => "ring",
        "ps" => "ps",
        "ps async" => "ps async",
        "zero 1" | "zero 2" => "zero 1",
        "zero 3" | "fsdp-hybrid" => "zero 3",
        "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zb-v" => "1f1b",
        "tensor-parallel" | "tp+pipeline" => "tensor-parallel",
        other => panic!("the table has a layout kind {other:?} that optimizer_family does not know: say which family's optimizer step it takes"),
    }
}

/// bf16 and fp16 runs against a one-process run at the same precision: autocast's 16-bit
/// products summed in another order (the batch split over ranks and micro-batches).
const HALF_TOLERANCE: f64 = 1e-2;
/// bf16 (8 bits of mantissa): tensor parallelism rounds each rank's partial product to bf16
/// before the group sums it, where one process rounds the whole product once (Megatron's sums
/// are bf16 too). Measured 1.5e-2 and 1.7e-2 after 3 steps (tensor-parallel, tp+pipeline).
const BF16_TOLERANCE: f64 = 3e-2;

fn row(row: &str, scratch: &Path) -> Row {
    let opts = |args: &[&str]| Row::Options { args: args.iter().map(|s| s.to_string()).collect(), plain_reference: false, tolerance: F32_TOLERANCE };
    let same_as_plain = |args: Vec<String>| Row::Options { args, plain_reference: true, tolerance: F32_TOLERANCE };
    let path = |name: &str| scratch.join(name).to_str().unwrap().to_string();
    if let Some(kind) = row.strip_prefix("layout:") {
        return Row::Layout(kind.to_string());
    }
    match row {
        "--precision tf32" => Row::Skip("TF32 needs a GPU (tests/gpu.rs)"),
        "--precision bf16" => Row::Options { args: vec!["--precision".into(), "bf16".into()], plain_reference: false, tolerance: BF16_TOLERANCE },
        // The loss scaler's first scale low enough that no run skips a step: a rank's loss is
        // its samples' sum times D / global (DDP's mean over its own samples), so with D ranks
        // each sample's fp16 gradient is D times one process's and overflows at another scale
        // (at GradScaler's 65536 the ring on 2 ranks skipped step 0, one process did not).
        "--precision fp16" => Row::Options { args: ["--precision", "fp16", "--loss-scale", "1024"].map(String::from).to_vec(), plain_reference: false, tolerance: HALF_TOLERANCE },
        "--optimizer lars" => opts(&["--optimizer", "lars", "--lr", "1"]),
        // Adam's first steps move every weight by about lr times the sign of its gradient, and
        // the ViT's attention key bias has a gradient of zero in exact arithmetic (softmax does
        // not see it): f32 noise, whose sign any other summation order flips (6e-4 apart with
        // the ring on 2 ranks). An eps above that noise keeps the comparison one of the update.
        "--optimizer adamw" => opts(&["--optimizer", "adamw", "--lr", "0.001", "--adam-eps", "1e-4"]),
        "--lr-schedule/--warmup-epochs/--scale-lr" => opts(&["--lr-schedule", "cosine", "--warmup-epochs", "0.25", "--scale-lr", "linear", "--base-batch", "4"]),
        "--label-smoothing" => opts(&["--label-smoothing", "0.1"]),
        "--overlap on" => same_as_plain(vec!["--overlap".into(), "on".into(), "--bucket-mb".into(), "0.001".into()]),
        "--channels-last" => opts(&["--channels-last"]),
        "--recompute" => same_as_plain(vec!["--recompute".into()]),
        "--checkpoint-dir" => same_as_plain(vec!["--checkpoint-dir".into(), path("checkpoints-{case}"), "--checkpoint-every".into(), "1".into()]),
        "--resume" => Row::Resume,
        // Every run here writes its weights: the row is the column's plain case.
        "--save-weights" => same_as_plain(Vec::new()),
        "--init-weights" => Row::Options { args: vec!["--init-weights".into(), "{init}".into()], plain_reference: false, tolerance: F32_TOLERANCE },
        "evaluation (without --no-eval)" => Row::Options { args: vec!["{eval}".into()], plain_reference: false, tolerance: F32_TOLERANCE },
        "HPC_TRAIN_FAULT" => Row::Elsewhere,
        "--profile-dir" => same_as_plain(vec!["--profile-dir".into(), path("profile-{case}"), "--profile-steps".into(), "1".into()]),
        "--pipeline-timeline" => same_as_plain(vec!["--pipeline-timeline".into(), path("timeline-{case}.json")]),
        "--timeline" => Row::Options { args: vec!["--timeline".into(), path("horovod-{case}.json")], plain_reference: false, tolerance: F32_TOLERANCE },
        "--compression" => Row::Options { args: vec!["--compression".into(), "fp16".into()], plain_reference: false, tolerance: HALF_TOLERANCE },
        "--hierarchical" => opts(&["--hierarchical"]),
        "--cache-data on" => opts(&["--cache-data", "on"]),
        // Every run here is strong scaling (the same global batch whatever the ranks).
        "--scaling strong" => same_as_plain(Vec::new()),
        other => panic!("the table has a row {other:?} that tests/conformance.rs does not know: say here how a run exercises it"),
    }
}

/// One line of `hpc-train conform --cases`, and what its outcome must be.
struct Case {
    ranks: usize,
    args: Vec<String>,
    expect: Expect,
    what: String,
}

enum Expect {
    /// Runs to completion (a reference, or the first half of a resume).
    Runs,
    /// The weights and final loss of case `reference` (test loss too when `eval`).
    Equals { reference: usize, tolerance: f64, eval: bool },
    /// Refused with this reason, naming these options.
    Refused { why: String, naming: Vec<String> },
}

struct Matrix {
    dir: PathBuf,
    data: String,
    /// The smaller images batch norm's cases train on (see [`BATCH_NORM_MODEL`]).
    batch_norm_data: String,
    cases: Vec<Case>,
    references: HashMap<String, usize>,
    /// The supported cases by what they run and what they must equal: a cell whose run is one
    /// made already (`--save-weights` and `--scaling strong` are every run's plain case, and
    /// `layout:zero 3` with fsdp-hybrid is fsdp-hybrid's) is checked on that run.
    trained: HashMap<String, usize>,
    /// Cells checked on another cell's run.
    shared: usize,
}

impl Matrix {
    fn common(&self, model: &str, index: usize, steps: &str) -> Vec<String> {
        let d = self.dir.display();
        let data = if model == BATCH_NORM_MODEL { &self.batch_norm_data } else { &self.data };
        [
            "--model", model, "--data", data, "--scaling", "strong", "--global-batch", "8", "--steps", steps, "--seed", "7",
            "--threads", "1", "--log-every", "1000", "--warmup-steps", "1", "--lr", "0.05",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--results={d}/results/{index}"), format!("--save-weights={d}/weights/{index}.safetensors")])
        .collect()
    }

    /// Options with the placeholders filled in for case `index`.
    fn fill(&self, args: &[String], model: &str, index: usize) -> (Vec<String>, bool) {
        let mut eval = false;
        let mut out = Vec::new();
        for a in args {
            match a.as_str() {
                "{eval}" => eval = true,
                "{init}" => out.push(format!("{}/init-{model}.safetensors", self.dir.display())),
                other => out.push(other.replace("{case}", &index.to_string())),
            }
        }
        // Options given twice are an error: a row's own --lr wins over the common one.
        (out, eval)
    }

    fn push(&mut self, ranks: usize, model: &str, steps: &str, extra: &[String], expect: Expect, what: String) -> usize {
        let index = self.cases.len();
        let (extra, eval) = self.fill(extra, model, index);
        let mut args = self.common(model, index, steps);
        // A row's own value of a common option replaces it.
        for flag in ["--lr"] {
            if extra.iter().any(|a| a == flag) {
                let at = args.iter().position(|a| a == flag).unwrap();
                args.drain(at..at + 2);
            }
        }
        if !eval {
            args.push("--no-eval".into());
        }
        args.extend(extra);
        self.cases.push(Case { ranks, args, expect, what });
        index
    }

    /// The plain run with `extra` (one process), made once.
    fn reference(&mut self, model: &str, extra: &[String]) -> usize {
        self.reference_on(1, model, extra)
    }

    /// The plain run with `extra` on `ranks` ranks, made once.
    fn reference_on(&mut self, ranks: usize, model: &str, extra: &[String]) -> usize {
        let key = format!("{ranks} x {model} {}", extra.join(" "));
        if let Some(&i) = self.references.get(&key) {
            return i;
        }
        let i = self.push(ranks, model, "3", extra, Expect::Runs, format!("plain {key}"));
        self.references.insert(key, i);
        i
    }

    /// The plain run a batch-norm case of `layout` must equal: batch norm normalises over each
    /// replica's micro-batch and each replica updates its own running statistics (DDP's batch
    /// norm; the record's weights hold the first replica's), so the reference is data
    /// parallelism (the ring) over the same replicas, each taking its samples in the same
    /// micro-batches: one process where the layout has one replica.
    fn batch_norm_reference(&mut self, layout: &Layout) -> usize {
        let mut extra: Vec<String> = Vec::new();
        if layout.replicas() > 1 {
            extra.extend(["--strategy".into(), "ring".into()]);
        }
        if layout.schedule.is_some() {
            extra.extend(["--micro-batches".into(), MICRO_BATCHES.into()]);
        }
        self.reference_on(layout.replicas(), BATCH_NORM_MODEL, &extra)
    }

    /// A supported cell's run of `model` (after its first half where the row resumes), which
    /// must equal case `reference`.
    #[allow(clippy::too_many_arguments)]
    fn push_supported(&mut self, row: &Row, ranks: usize, model: &str, run_args: &[String], reference: usize, tolerance: f64, eval: bool, what: String) {
        let mut run_args = run_args.to_vec();
        if let Row::Resume = row {
            let checkpoints = format!("--checkpoint-dir={}/checkpoints-{}", self.dir.display(), self.cases.len());
            let first: Vec<String> = run_args.iter().cloned().chain([checkpoints.clone()]).collect();
            self.push(ranks, model, "2", &first, Expect::Runs, format!("{what}, first 2 steps"));
            run_args.extend([checkpoints, "--resume".into()]);
        }
        // Options with a placeholder are filled per case (its own folder or file), and a
        // resume's first half is a case of its own: those are never shared.
        let key = format!("{ranks} {model} {} = {reference} {tolerance} {eval}", run_args.join(" "));
        let fresh = matches!(row, Row::Resume) || run_args.iter().any(|a| a.contains('{'));
        if let (false, Some(&index)) = (fresh, self.trained.get(&key)) {
            let case = &mut self.cases[index];
            case.what = format!("{}; {what}", case.what);
            self.shared += 1;
            return;
        }
        let index = self.push(ranks, model, "3", &run_args, Expect::Equals { reference, tolerance, eval }, what);
        self.trained.insert(key, index);
    }
}

/// The model with batch norm that the cells of [`batch_norm_cell`] train too, on 1x12x12 images
/// (its running statistics and its batch statistics over micro-batches are what the tiny CNN,
/// which has none, cannot show).
const BATCH_NORM_MODEL: &str = "resnet18";
/// A pipeline's micro-batches in every run here (`Layout::args`).
const MICRO_BATCHES: &str = "2";

/// Whether the supported cell (`row`, `column`) also trains the batch-norm model: the rows whose
/// options or layouts touch the forward, where batch norm's statistics can go wrong and the tiny
/// CNN has none to lose. `--recompute` runs every chunk's forward again (its running statistics
/// must count each micro-batch once); pipelines cut the forward into stages and micro-batches,
/// `--zero 3` into units it recomputes (each against the ring: the replicas' own statistics, the
/// first one's written); a resume carries the running statistics through a checkpoint, written
/// and read (against one column of each family: data parallelism, sharded units, a pipeline).
/// About 15 runs of ResNet-18 at 12x12, each about a second of CPU time more than the tiny CNN's.
fn batch_norm_cell(row: &str, column: &str) -> bool {
    // A pair of layouts trains once, in whichever order the table lists it first (`plan`).
    let forward_layout = |kind: &str| ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "zero 3"].contains(&kind);
    match row {
        "--recompute" => true,
        "--resume" => ["ring", "zero 3", "1f1b"].contains(&column),
        "layout:ring" => forward_layout(column),
        _ => row.strip_prefix("layout:").is_some_and(|kind| forward_layout(kind) && column == "ring"),
    }
}

/// The options a one-process reference of `args` keeps: those of the horovod-only rows need
/// Horovod's strategy, whose one-rank exchange is the identity.
fn reference_options(row: &str, args: &[String]) -> Vec<String> {
    match row {
        "--timeline" | "--compression" | "--hierarchical" => [vec!["--strategy".to_string(), "horovod".into()], args.to_vec()].concat(),
        _ => args.to_vec(),
    }
}

/// The runs the table asks for, and what it holds.
struct Planned {
    matrix: Matrix,
    supported: usize,
    refused: usize,
    skipped: Vec<String>,
    elsewhere: usize,
    /// Layout pairs met a second time in the other order (trained or refused once).
    mirrored: usize,
    /// Supported pairs that also trained the batch-norm model ([`batch_norm_cell`]).
    batch_norm: usize,
    reasons: Vec<String>,
}

fn plan(dir: &Path) -> Planned {
    let data = synth(dir, "data", 64, 16, "1x16x16", 4);
    let batch_norm_data = synth(dir, "batch-norm-data", 64, 0, "1x12x12", 4);
    let mut m = Matrix {
        dir: dir.to_path_buf(),
        data: data.to_str().unwrap().into(),
        batch_norm_data: batch_norm_data.to_str().unwrap().into(),
        cases: Vec::new(),
        references: HashMap::new(),
        trained: HashMap::new(),
        shared: 0,
    };
    // Initial weights for --init-weights: one step of each model, written by the first cases.
    for model in ["tiny", "vit-tiny"] {
        let out = format!("--save-weights={}/init-{model}.safetensors", dir.display());
        let i = m.push(1, model, "1", &[], Expect::Runs, format!("initial weights of {model}"));
        let at = m.cases[i].args.iter().position(|a| a.starts_with("--save-weights=")).unwrap();
        m.cases[i].args[at] = out;
    }
    let (mut supported, mut refused, mut skipped, mut elsewhere, mut batch_norm) = (0, 0, Vec::new(), 0, 0);
    let table = table();
    let mut reasons: Vec<String> = table.iter().filter(|c| c.verdict == "no").map(|c| c.why.clone()).collect();
    reasons.dedup();
    // Each unordered pair of layout kinds once. The table lists {a, b} as row a, column b and
    // as row b, column a; src/plan/compat.rs's `pair` gives both the same verdict (its unit test
    // pairs_of_kinds_are_symmetric), and `Layout::with` builds the same command line from
    // either order (each kind sets its own options; tp+pipeline's schedule only where none is
    // set), so the second cell would train the very run of the first, or be refused by the same
    // check with the same reason. The second cell's verdict and reason are still compared with
    // the first's here, so that a table that stops being symmetric fails rather than losing a case.
    let mut pairs_seen: HashMap<(String, String), (String, String)> = HashMap::new();
    let mut mirrored = 0;
    for cell in table {
        if cell.verdict == "n/a" {
            continue;
        }
        if let Some(kind) = cell.row.strip_prefix("layout:") {
            let key = if kind <= cell.column.as_str() { (kind.to_string(), cell.column.clone()) } else { (cell.column.clone(), kind.to_string()) };
            if let Some((verdict, why)) = pairs_seen.get(&key) {
                assert_eq!((verdict, why), (&cell.verdict, &cell.why), "{} x {}: the pair's other order has another verdict", cell.row, cell.column);
                mirrored += 1;
                continue;
            }
            pairs_seen.insert(key, (cell.verdict.clone(), cell.why.clone()));
        }
        if cell.verdict == "yes" && OPTIMIZER_ONLY_ROWS.contains(&cell.row.as_str()) && optimizer_family(&cell.column) != cell.column {
            skipped.push(format!("{} x {}: an optimizer-only option, trained against {}", cell.row, cell.column, optimizer_family(&cell.column)));
            continue;
        }
        let layout = Layout::default().with(&cell.column);
        let row = row(&cell.row, dir);
        let (layout, extra, reference_extra, tolerance, naming) = match &row {
            Row::Skip(why) => {
                skipped.push(format!("{} x {}: {why}", cell.row, cell.column));
                continue;
            }
            Row::Elsewhere => {
                elsewhere += 1;
                continue;
            }
            Row::Layout(kind) => {
                let both = layout.clone().with(kind);
                let naming = vec![cell.row_flag.clone(), cell.column_flag.clone()];
                (both, Vec::new(), Vec::new(), F32_TOLERANCE, naming)
            }
            Row::Options { args, plain_reference, tolerance } => {
                let reference = if *plain_reference { Vec::new() } else { reference_options(&cell.row, args) };
                (layout.clone(), args.clone(), reference, *tolerance, vec![cell.row_flag.clone(), cell.column_flag.clone()])
            }
            Row::Resume => (layout.clone(), Vec::new(), Vec::new(), F32_TOLERANCE, vec!["--resume".into(), cell.column_flag.clone()]),
        };
        let (model, ranks) = (layout.model(), layout.ranks());
        let mpich = common::launcher::mpi() == common::launcher::Mpi::Mpich;
        // MPICH polls without yielding, and 8 ranks on CI's 2 cores made its matrix take 7
        // minutes: under MPICH the pairs that need 8 ranks (a strategy's replicas of a
        // tensor-parallel pipeline) are left to Open MPI's run, which has them all.
        if ranks > MPICH_MOST_RANKS && mpich {
            skipped.push(format!("{} x {}: {ranks} ranks (Open MPI's run only)", cell.row, cell.column));
            continue;
        }
        if mpich && cell.verdict == "yes" && !matches!(row, Row::Layout(_)) && !MPICH_OPTION_COLUMNS.contains(&cell.column.as_str()) {
            skipped.push(format!("{} x {}: an option against a column of a family MPICH's run trains once (Open MPI's run only)", cell.row, cell.column));
            continue;
        }
        // The zero-bubble schedules send 1F1B's messages (whose column MPICH's run trains) and
        // ZB-V's turn to itself, which tests/pipeline.rs runs under MPICH; their arithmetic
        // with every other kind is Open MPI's run's.
        let zero_bubble = |kind: &str| kind == "zb-h1" || kind == "zb-v";
        if mpich && cell.verdict == "yes" && (zero_bubble(&cell.column) || matches!(&row, Row::Layout(k) if zero_bubble(k))) {
            skipped.push(format!("{} x {}: a zero-bubble schedule (Open MPI's run only)", cell.row, cell.column));
            continue;
        }
        let mut run_args = layout.args();
        run_args.extend(extra.iter().cloned());
        let what = format!("{} x {}", cell.row, cell.column);
        if cell.verdict == "no" {
            if matches!(row, Row::Resume) {
                // Alone, so that the refusal names it (with --checkpoint-dir that option's
                // refusal would come first).
                run_args.push("--resume".into());
            }
            m.push(ranks, model, "3", &run_args, Expect::Refused { why: cell.why.clone(), naming }, what);
            refused += 1;
            continue;
        }
        assert_eq!(cell.verdict, "yes", "{what}");
        let reference = m.reference(model, &reference_extra);
        let eval = extra.iter().any(|a| a == "{eval}");
        m.push_supported(&row, ranks, model, &run_args, reference, tolerance, eval, what.clone());
        supported += 1;
        // Under MPICH the tiny CNN's cells alone: what batch norm adds is the forward's own
        // arithmetic (running statistics counted once per micro-batch, carried through a
        // checkpoint), which no MPI call changes; Open MPI's run has every such cell.
        if model == "tiny" && batch_norm_cell(&cell.row, &cell.column) && !mpich {
            // The rows batch norm is added to compare with the plain run without options of
            // their own (same_as_plain, a layout, a resume): the reference is the layout's.
            assert!(reference_extra.is_empty() && !eval, "{what}: a batch-norm cell's reference takes no options of the row");
            // F32_TOLERANCE holds as for the tiny CNN: SGD at a small rate for 3 steps, and both
            // runs normalise the same micro-batches and sum their gradients in micro-batch order
            // (at most the ring's order differs); a running statistic counted twice or another
            // replica's is off by far more (0.1 of a batch's statistics per update).
            let reference = m.batch_norm_reference(&layout);
            m.push_supported(&row, ranks, BATCH_NORM_MODEL, &run_args, reference, tolerance, false, format!("{what} ({BATCH_NORM_MODEL})"));
            batch_norm += 1;
        }
    }

    Planned { matrix: m, supported, refused, skipped, elsewhere, mirrored, batch_norm, reasons }
}

#[test]
fn every_supported_pair_equals_the_plain_run_and_every_refused_pair_is_refused() {
    let dir = scratch("conformance");
    let Planned { matrix: m, supported, refused, skipped, elsewhere, mirrored, batch_norm, reasons } = plan(&dir);
    let cases_file = dir.join("cases.txt");
    let text: String = m.cases.iter().map(|c| format!("{} {}\n", c.ranks, c.args.join(" "))).collect();
    std::fs::write(&cases_file, text).unwrap();
    let world = m.cases.iter().map(|c| c.ranks).max().unwrap();
    let report = dir.join("report.tsv");
    let run = mpirun_env(world, &["conform", "--cases", cases_file.to_str().unwrap(), "--report", report.to_str().unwrap()], &[], Duration::from_secs(900));
    assert!(run.ok(), "the conformance launch failed ({:?}, timed out: {}):\n{}", run.status, run.timed_out, tail(&run.all_output(), 4000));
    let outcomes: Vec<(String, String)> = std::fs::read_to_string(&report)
        .unwrap()
        .lines()
        .map(|l| {
            let mut f = l.splitn(3, '\t');
            let _index = f.next();
            (f.next().unwrap_or("").to_string(), f.next().unwrap_or("").to_string())
        })
        .collect();
    assert_eq!(outcomes.len(), m.cases.len(), "one outcome per case");

    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for (index, case) in m.cases.iter().enumerate() {
        let (status, message) = &outcomes[index];
        match &case.expect {
            Expect::Runs | Expect::Equals { .. } if status != "ok" => failures.push(format!("{}: {status} {message}", case.what)),
            Expect::Runs => {}
            Expect::Equals { reference, tolerance, eval } => {
                let weights = |i: usize| dir.join(format!("weights/{i}.safetensors"));
                let diff = max_relative_difference(&weights(*reference), &weights(index));
                worst = worst.max(if *tolerance == F32_TOLERANCE { diff } else { 0.0 });
                if diff.is_nan() || diff > *tolerance {
                    failures.push(format!("{}: weights {diff:e} from the plain run's (tolerance {tolerance:e})", case.what));
                }
                let record = |i: usize| read_runs(&dir.join(format!("results/{i}"))).pop().unwrap();
                let (mine, plain) = (record(index), record(*reference));
                let mut fields = vec!["final_loss"];
                if *eval {
                    fields.push("test_loss");
                }
                for field in fields {
                    let (a, b) = (mine[field].as_f64().unwrap_or(f64::NAN), plain[field].as_f64().unwrap_or(f64::NAN));
                    if !((a - b).abs() <= tolerance.max(1e-5) * b.abs().max(1.0)) {
                        failures.push(format!("{}: {field} {a} against the plain run's {b}", case.what));
                    }
                }
            }
            Expect::Refused { why, naming } => {
                // A run of a kind that implies others (fsdp-hybrid is stage 3's; tp+pipeline a
                // schedule's and tensor parallelism's) may meet another refused pair of the
                // table first: any of the table's reasons, naming an option of each side.
                let named = naming.iter().all(|n| implied(n).iter().any(|f| message.contains(f.as_str())));
                let reason = message.contains(why.as_str()) || reasons.iter().any(|r| message.contains(r.as_str()));
                if status != "refused" || !reason || !named {
                    failures.push(format!("{}: expected a refusal naming {naming:?} because {why:?}; got {status} {message}", case.what));
                }
                // Refused before anything starts: no record appended, no weights written.
                if dir.join(format!("results/{index}/runs.jsonl")).exists() || dir.join(format!("weights/{index}.safetensors")).exists() {
                    failures.push(format!("{}: refused, but it wrote a record or weights", case.what));
                }
            }
        }
    }
    eprintln!(
        "conformance: {supported} supported pairs equal to the plain run ({batch_norm} of them with {BATCH_NORM_MODEL} too; largest fp32 difference {worst:e}), {refused} refused pairs refused, {mirrored} layout pairs the other way round, {} cells checked on another cell's identical run, {elsewhere} fault pairs in faults_end_every_layout_kind, {} skipped: {skipped:?}; {} runs in one launch of {world} ranks in {:.1} s",
        m.shared,
        skipped.len(),
        m.cases.len(),
        run.elapsed.as_secs_f64()
    );
    assert!(failures.is_empty(), "{} of {} pairs do not conform:\n{}", failures.len(), supported + refused, failures.join("\n"));
}

/// The table's fault row: an injected fault ends the job in every layout kind, non-zero, with
/// a line naming the rank and what happened (for a stall: what the others waited for), within
/// `--exchange-timeout-s` plus a few seconds. Each kind takes one of the faults in turn, so that
/// every fault meets several kinds at the cost of one launch per kind (tests/reliability.rs
/// runs each fault at length in the plain step and in pipelines).
#[test]
fn faults_end_every_layout_kind() {
    let dir = scratch("conformance-faults");
    let data = synth(&dir, "data", 64, 16, "1x16x16", 4);
    let faults: [(&str, &str); 5] = [
        ("nan@0:1", "non-finite"),
        ("stall@0:1:60", "watchdog"),
        ("error@0:1", "the forward failed"),
        ("nangrad@0:1", "non-finite"),
        ("exit@0:1", "exiting at step 1"),
    ];
    let kinds: Vec<String> = table().into_iter().filter(|c| c.row == "HPC_TRAIN_FAULT" && c.verdict == "yes").map(|c| c.column).collect();
    assert_eq!(kinds.len(), 18, "{kinds:?}");
    for (i, kind) in kinds.iter().enumerate() {
        // The zero-bubble schedules fail through 1F1B's executor and messages: under MPICH,
        // its column stands for them (Open MPI's run faults all 18 kinds).
        if !common::launcher::every_row() && (kind == "zb-h1" || kind == "zb-v") {
            continue;
        }
        let layout = Layout::default().with(kind);
        let (fault, said) = faults[i % faults.len()];
        let mut args: Vec<String> = [
            "--model", layout.model(), "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "8", "--steps", "4",
            "--threads", "1", "--no-eval", "--exchange-timeout-s", "4", "--results", dir.join("results").to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(layout.args());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let run = mpirun_env(layout.ranks(), &args, &[("HPC_TRAIN_FAULT", fault)], Duration::from_secs(60));
        let output = run.all_output();
        assert!(!run.ok() && !run.timed_out, "{kind} with {fault}: {:?} after {:?}\n{output}", run.status, run.elapsed);
        assert!(output.contains(said) && output.contains("rank"), "{kind} with {fault}: no line saying {said:?}\n{output}");
        assert!(run.elapsed < Duration::from_secs(4 + 12), "{kind} with {fault}: ended after {:?}", run.elapsed);
    }
}

/// A refused pair launched as a user launches it: one line names both options, every rank
/// exits non-zero, at once (before any step: nothing is appended to runs.jsonl and no weights
/// are written). One of each kind of refusal, an option with a layout kind and a pair of
/// layout kinds: every reason of the table is refused by the same check (src/plan/compat.rs's
/// `check`, which train/plan.rs calls before any MPI collective of the run), and the matrix
/// above has each refused pair refused inside `conform` with its reason, both options named,
/// agreed by every rank (a rank's own error ends the conform launch) and nothing written. What
/// a launch adds is how the refused job ends, which does not depend on the reason.
#[test]
fn a_refused_pair_ends_the_launch_at_once_with_one_line() {
    let dir = scratch("conformance-launches");
    let Planned { matrix: m, .. } = plan(&dir);
    let mut seen = Vec::new();
    for (index, case) in m.cases.iter().enumerate() {
        let Expect::Refused { why, naming } = &case.expect else { continue };
        let of_layouts = case.what.starts_with("layout:");
        if seen.contains(&of_layouts) {
            continue;
        }
        seen.push(of_layouts);
        let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
        let run = mpirun_env(case.ranks, &args, &[], Duration::from_secs(60));
        let output = run.all_output();
        assert!(!run.ok() && !run.timed_out, "{}: {:?}\n{output}", case.what, run.status);
        assert_eq!(output.matches(why.as_str()).count(), 1, "{}: the reason once\n{output}", case.what);
        let line = output.lines().find(|l| l.contains(why.as_str())).unwrap();
        assert!(naming.iter().all(|n| implied(n).iter().any(|f| line.contains(f.as_str()))), "{}: {line}", case.what);
        assert!(run.elapsed < Duration::from_secs(20), "{}: {:?}", case.what, run.elapsed);
        assert!(!dir.join(format!("results/{index}/runs.jsonl")).exists() && !dir.join(format!("weights/{index}.safetensors")).exists(), "{}", case.what);
    }
    assert_eq!(seen.len(), 2, "a refused option with a layout and a refused pair of layouts: {seen:?}");
}

/// The flags a refusal may name for an option or kind of the table: its own, or those of the
/// kinds it implies.
fn implied(flag: &str) -> Vec<String> {
    let mut flags = vec![flag.to_string()];
    match flag {
        "--fsdp-hybrid" => flags.push("--zero 3".into()),
        "--tensor-parallel and --pipeline-stages" => flags.extend(["--tensor-parallel".into(), "--pipeline-stages (--schedule 1f1b)".into()]),
        _ => {}
    }
    flags
}

fn tail(s: &str, n: usize) -> &str {
    &s[s.len().saturating_sub(n)..]
}
