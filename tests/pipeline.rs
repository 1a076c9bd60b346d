//! Pipeline parallelism (`--pipeline-stages`, `--micro-batches`, `--schedule`) launched as
//! users launch it: every schedule, stage count and micro-batch count trains the tiny CNN (no
//! batch norm) to the weights of one process that accumulates the same micro-batches'
//! gradients, and pipelines of two replicas do so with every exchange strategy; the record
//! and the timeline say what ran; bad layouts end with one clear line and every rank non-zero.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::*;

/// A small dataset (512 samples of 1x16x16) shared by the tests of this binary.
fn data() -> &'static Path {
    static DATA: OnceLock<PathBuf> = OnceLock::new();
    DATA.get_or_init(|| synth(&scratch("pipeline-data"), "small", 512, 96, "1x16x16", 10))
}

/// The options every run here shares: the tiny CNN, 4 steps of `batch` samples per pipeline.
fn base(batch: usize) -> Vec<String> {
    base_steps(batch, 4)
}

fn base_steps(batch: usize, steps: usize) -> Vec<String> {
    let (batch, steps) = (batch.to_string(), steps.to_string());
    ["--model", "tiny", "--data", data().to_str().unwrap(), "--steps", &steps, "--batch-size", &batch, "--threads", "1", "--no-eval", "--lr", "0.1"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

fn train(dir: &Path, name: &str, ranks: usize, batch: usize, extra: &[&str]) -> PathBuf {
    let mut args = base(batch);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    train_saving_weights(dir, name, ranks, &args)
}


/// A sweep's runs in one launch (common::Runs), each reference trained once, then every
/// comparison: (what, reference, weights, tolerance).
struct Sweep {
    runs: Runs,
    references: std::collections::HashMap<String, PathBuf>,
    compared: Vec<(String, PathBuf, PathBuf, f64)>,
}

impl Sweep {
    fn new(dir: &Path) -> Sweep {
        Sweep { runs: Runs::new(dir), references: Default::default(), compared: Vec::new() }
    }

    /// A run of the tiny CNN with `base(batch)`'s options and `extra`.
    fn train(&mut self, name: &str, ranks: usize, batch: usize, extra: &[&str]) -> PathBuf {
        let mut args = base(batch);
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.runs.add(name, ranks, &args)
    }

    /// One process, one stage, M micro-batches: the reference each layout must reproduce (added
    /// once).
    fn reference(&mut self, batch: usize, micro: usize) -> PathBuf {
        let name = format!("reference-b{batch}-m{micro}");
        if let Some(path) = self.references.get(&name) {
            return path.clone();
        }
        let path = self.train(&name, 1, batch, &["--micro-batches", &micro.to_string()]);
        self.references.insert(name, path.clone());
        path
    }

    fn compare(&mut self, what: String, want: &Path, got: PathBuf, tolerance: f64) {
        self.compared.push((what, want.to_path_buf(), got, tolerance));
    }

    /// Launches every run, then checks every comparison (each one's difference printed).
    fn check(mut self) {
        self.runs.launch();
        let mut report = Vec::new();
        for (what, want, got, tolerance) in &self.compared {
            let diff = max_relative_difference(want, got);
            report.push(format!("{what}: {diff:e}"));
            assert!(diff < *tolerance, "{what}: weights differ from one process by {diff:e} (tolerance {tolerance:e})\n{}", report.join("\n"));
        }
        eprintln!("{}", report.join("\n"));
    }
}

#[test]
fn every_schedule_trains_the_weights_of_one_process_accumulating_the_micro_batches() {
    let dir = scratch("pipeline-equality");
    // (stages, schedule, virtual stages, micro-batches); one pipeline (D = 1).
    let layouts: &[(usize, &str, usize, usize)] = &[
        (2, "gpipe", 1, 1),
        (2, "gpipe", 1, 4),
        (2, "gpipe", 1, 8),
        (2, "1f1b", 1, 1),
        (2, "1f1b", 1, 4),
        (2, "1f1b", 1, 8),
        (2, "interleaved", 2, 4),
        (2, "interleaved", 2, 8),
        (3, "gpipe", 1, 4),
        (3, "1f1b", 1, 1),
        (3, "1f1b", 1, 8),
        (4, "gpipe", 1, 8),
        (4, "1f1b", 1, 1),
        (4, "1f1b", 1, 4),
    ];
    // Under MPICH one row of each schedule and stage count's message pattern (the arithmetic is
    // the same under any MPI: Open MPI's run has every row).
    let layouts = common::launcher::rows_under_mpich(layouts, |(p, schedule, _, m)| matches!((p, schedule, m), (2, "1f1b", 4) | (2, "interleaved", 4) | (3, "1f1b", 8) | (4, "gpipe", 8)));
    let mut sweep = Sweep::new(&dir);
    for (p, schedule, v, m) in layouts {
        let want = sweep.reference(32, m);
        let name = format!("p{p}-{schedule}-v{v}-m{m}");
        let (ps, vs, ms) = (p.to_string(), v.to_string(), m.to_string());
        let mut extra = vec!["--pipeline-stages", &ps, "--schedule", schedule, "--micro-batches", &ms, "--partition", "params"];
        if v > 1 {
            extra.extend(["--virtual-stages", &vs]);
        }
        let got = sweep.train(&name, p, 32, &extra);
        // The same operations in the same order as the reference: equal to f32 summation
        // tolerance (in practice bit for bit).
        sweep.compare(name, &want, got, 1e-6);
    }
    sweep.check();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn two_pipelines_average_their_stages_gradients_with_every_strategy() {
    let dir = scratch("pipeline-hybrid");
    // Two pipelines of 16 samples each against one process taking 32 in 4 micro-batches.
    let mut sweep = Sweep::new(&dir);
    let want = sweep.reference(32, 4);
    for strategy in ["ring", "rhd", "auto", "allreduce", "horovod"] {
        let got = sweep.train(&format!("d2p2-{strategy}"), 4, 16, &["--pipeline-stages", "2", "--micro-batches", "2", "--strategy", strategy, "--partition", "1"]);
        // The replicas' mean reorders float additions: f32 summation tolerance.
        sweep.compare(format!("D=2 x P=2 with {strategy}"), &want, got, 1e-5);
    }
    // ZeRO stage 1 among each stage's replicas.
    let got = sweep.train("d2p2-ring-zero1", 4, 16, &["--pipeline-stages", "2", "--micro-batches", "2", "--strategy", "ring", "--zero", "1", "--partition", "1"]);
    sweep.compare("ZeRO 1 in a hybrid layout".into(), &want, got, 1e-5);
    // A whole replica on each of two ranks, micro-batches accumulated: data parallelism with
    // gradient accumulation, through the same executor.
    let got = sweep.train("d2p1", 2, 16, &["--micro-batches", "2"]);
    sweep.compare("D=2 x P=1".into(), &want, got, 1e-5);
    sweep.check();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Recomputing forwards in backward changes memory, not arithmetic; the evaluation runs through
/// the stages and scores as one process does; the record and the timeline say what ran.
#[test]
fn recompute_evaluation_record_and_timeline() {
    let dir = scratch("pipeline-record");
    let with_eval = |name: &str, ranks: usize, extra: &[&str]| {
        let mut args: Vec<String> = base(32).into_iter().filter(|a| a != "--no-eval").collect();
        args.extend(["--epochs", "1"].iter().map(|s| s.to_string()));
        let pos = args.iter().position(|a| a == "--steps").unwrap();
        args.drain(pos..pos + 2);
        args.extend(extra.iter().map(|s| s.to_string()));
        let results = dir.join(name);
        args.extend(["--results".into(), results.to_str().unwrap().into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let run = mpirun(ranks, &args).expect_ok();
        (run, read_runs(&results).pop().unwrap())
    };
    let (_, plain) = with_eval("plain", 1, &["--micro-batches", "4"]);
    let (_, whole) = with_eval("whole", 1, &[]);
    let timeline = dir.join("timeline.json");
    let (run, piped) = with_eval("piped", 3, &["--pipeline-stages", "3", "--micro-batches", "4", "--schedule", "gpipe", "--recompute", "--pipeline-timeline", timeline.to_str().unwrap()]);
    assert!(run.stderr.contains("pipeline: 1 replica(s) x 3 stage(s), 4 micro-batch(es)"), "{}", run.stderr);
    assert!(run.stderr.contains("chunk 2 on stage 2: blocks"), "{}", run.stderr);
    assert!(run.stderr.contains("the training split's images") && run.stderr.contains("its last stage reads the labels alone, the stages between read nothing"), "{}", run.stderr);
    assert_eq!(piped["test_accuracy"], plain["test_accuracy"], "the pipelined evaluation scores as one process");
    let (a, b) = (piped["final_loss"].as_f64().unwrap(), plain["final_loss"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-5 * b.abs(), "final loss {a} against {b}");
    let p = &piped["pipeline"];
    assert_eq!((p["pipeline_stages"].as_u64(), p["micro_batches"].as_u64(), p["schedule"].as_str()), (Some(3), Some(4), Some("gpipe")));
    assert_eq!(p["recompute"], true);
    assert_eq!(p["partition"], "time");
    assert_eq!(p["bubble"].as_array().unwrap().len(), 3);
    assert!(p["bubble"].as_array().unwrap().iter().all(|b| (0.0..1.0).contains(&b.as_f64().unwrap())), "{p}");
    assert_eq!(p["theoretical_bubble"].as_f64().unwrap(), 2.0 / 6.0);
    // GPipe holds every micro-batch on every stage.
    assert_eq!(p["peak_alive_micro_batches"], serde_json::json!([4, 4, 4]));
    assert_eq!(p["chunk_profiled_ms"].as_array().unwrap().len(), 3);
    assert!(plain["pipeline"]["pipeline_stages"].as_u64() == Some(1));
    // Against the plain evaluation of the plain step's weights (which differ in the order of
    // additions only): at most one of the 96 test images scored otherwise.
    let (a, b) = (piped["test_accuracy"].as_f64().unwrap(), whole["test_accuracy"].as_f64().unwrap());
    assert!((a - b).abs() <= 1.0 / 96.0 + 1e-12, "accuracy {a} against the plain run's {b}");
    assert!(whole.get("pipeline").is_none());
    // The timeline: valid JSON, a thread per rank, forwards and backwards of every micro-batch.
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&timeline).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for stage in 0..3 {
        for m in 0..4 {
            for what in ["forward", "backward"] {
                let name = format!("{what} {m} (chunk {stage})");
                assert!(events.iter().any(|e| e["name"] == name.as_str() && e["tid"] == stage), "no {name:?} on stage {stage}");
            }
        }
    }
    assert!(events.iter().any(|e| e["name"] == "wait activation 0" && e["tid"] == 1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run of `extra` on `ranks` ranks with the evaluation at its end (4 steps of 32 samples per
/// pipeline): its weights and its record.
fn train_evaluating(dir: &Path, name: &str, ranks: usize, batch: usize, extra: &[&str]) -> (PathBuf, serde_json::Value) {
    let mut args: Vec<String> = base(batch).into_iter().filter(|a| a != "--no-eval").collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let results = dir.join(name);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let weights = train_saving_weights(&results, name, ranks, &args);
    (weights, read_runs(&results).pop().unwrap())
}

/// The test loss and accuracy of `got` equal `want`'s: the same samples scored by the same
/// weights, up to the order of f32 sums (the loss) and never a sample scored otherwise.
fn assert_same_evaluation(what: &str, got: &serde_json::Value, want: &serde_json::Value, tolerance: f64) {
    let (a, b) = (got["test_loss"].as_f64().unwrap(), want["test_loss"].as_f64().unwrap());
    assert!((a - b).abs() <= tolerance * b.abs(), "{what}: test loss {a} against one process's {b}");
    assert_eq!(got["test_accuracy"], want["test_accuracy"], "{what}: test accuracy");
}

/// The first stage of every pipeline reads the images and no labels, the last the labels and
/// no images, the stages between nothing, in training and in evaluation; with --cache-data the
/// first stage alone holds the split. The samples are the same, in the same order: the weights
/// and the evaluation are one process's.
#[test]
fn each_stage_reads_only_the_data_it_uses() {
    let dir = scratch("pipeline-parts");
    let (train, test, sample) = (4 * 32u64, 96u64, 16 * 16u64);
    let (want, plain) = train_evaluating(&dir, "reference", 1, 32, &["--micro-batches", "4"]);
    // (name, ranks, layout); every one a single pipeline of 32 samples in 4 micro-batches.
    let layouts: &[(&str, usize, &[&str])] = &[
        ("p2-1f1b-cached", 2, &["--pipeline-stages", "2", "--schedule", "1f1b", "--cache-data", "on"]),
        ("p3-gpipe", 3, &["--pipeline-stages", "3", "--schedule", "gpipe", "--cache-data", "off"]),
        ("p2-interleaved", 2, &["--pipeline-stages", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--cache-data", "off"]),
    ];
    for &(name, ranks, layout) in layouts {
        let mut extra = vec!["--micro-batches", "4", "--partition", "params"];
        extra.extend(layout);
        let (got, record) = train_evaluating(&dir, name, ranks, 32, &extra);
        let diff = max_relative_difference(&want, &got);
        assert!(diff < 1e-6, "{name}: weights differ from one process by {diff:e}");
        let (a, b) = (record["final_loss"].as_f64().unwrap(), plain["final_loss"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{name}: final loss {a} against one process's {b}");
        assert_same_evaluation(name, &record, &plain, 1e-6);
        let cached = layout.contains(&"on");
        assert_eq!(record["extra"]["data_cached"], cached, "{name}: rank 0 holds the split");
        let ranks_read = record["pipeline"]["ranks"].as_array().unwrap_or_else(|| panic!("{name}: no ranks in {record}"));
        assert_eq!(ranks_read.len(), ranks, "{name}");
        for r in ranks_read {
            let stage = r["stage"].as_u64().unwrap();
            let (first, last) = (stage == 0, stage + 1 == ranks as u64);
            let read = |field: &str| r[field].as_u64().unwrap();
            let expected = [
                ("train_image_bytes", if first { train * sample } else { 0 }),
                ("train_labels", if last { train } else { 0 }),
                ("test_image_bytes", if first { test * sample } else { 0 }),
                ("test_labels", if last { test } else { 0 }),
                ("cached_image_bytes", if first && cached { 512 * sample } else { 0 }),
            ];
            for (field, value) in expected {
                assert_eq!(read(field), value, "{name}: {field} of stage {stage} in {r}");
            }
            assert!(r["peak_rss_mb"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Evaluation runs the test set through the stages in micro-batches of training's size,
/// pipelined, and scores as one process's plain evaluation (whole batches of 2 x the batch,
/// one model): on 2 and 3 stages, interleaved, and on two pipelines of 2 stages. Every run
/// starts from the same trained weights and steps once with a rate too small to change any of
/// them (1e-30 times a gradient is below the last bit of every weight that is not zero), so
/// that the evaluations score the same model and only their arithmetic can differ.
#[test]
fn pipelined_evaluation_scores_as_one_process() {
    let dir = scratch("pipeline-evaluation");
    let trained = train(&dir, "trained", 1, 32, &[]);
    let init = trained.to_str().unwrap();
    let evaluate = |name: &str, ranks: usize, batch: usize, layout: &[&str]| {
        let mut extra = vec!["--init-weights", init, "--lr", "1e-30", "--steps", "1"];
        extra.extend(layout);
        let mut args: Vec<String> = base(batch).into_iter().filter(|a| a != "--no-eval").collect();
        for given in ["--steps", "--lr"] {
            let at = args.iter().position(|a| a == given).unwrap();
            args.drain(at..at + 2);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let results = dir.join(name);
        args.extend(["--results".into(), results.to_str().unwrap().into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        mpirun(ranks, &args).expect_ok();
        read_runs(&results).pop().unwrap()
    };
    let plain = evaluate("plain", 1, 32, &[]);
    assert!(plain.get("pipeline").is_none(), "the reference is the plain evaluation");
    for (name, ranks, batch, layout) in [
        ("p2-m4", 2, 32, &["--pipeline-stages", "2", "--micro-batches", "4"][..]),
        ("p3-m4", 3, 32, &["--pipeline-stages", "3", "--micro-batches", "4", "--schedule", "gpipe"]),
        ("p2-interleaved-m4", 2, 32, &["--pipeline-stages", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2", "--partition", "params"]),
        // The V: the last chunk (the scores) on the first stage, its turn kept on stage 1.
        ("p2-zb-v-m4", 2, 32, &["--pipeline-stages", "2", "--micro-batches", "4", "--schedule", "zb-v", "--partition", "params"]),
        ("d2-p2-m2", 4, 16, &["--pipeline-stages", "2", "--micro-batches", "2"]),
    ] {
        let record = evaluate(name, ranks, batch, layout);
        // Micro-batches of 8 summed in f32 against batches of 64: f32 summation tolerance.
        assert_same_evaluation(name, &record, &plain, 1e-6);
        assert!(record["extra"]["evaluation_s"].as_f64().unwrap() > 0.0, "{name}: {record}");
        // Each pipeline's last stage scores its replica's share of the test set.
        let scored: u64 = record["pipeline"]["ranks"].as_array().unwrap().iter().map(|r| r["test_labels"].as_u64().unwrap()).sum();
        assert_eq!(scored, 96, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pipelined run's checkpoint holds the whole model in the usual format; a run resumes from
/// it with another number of stages, or of pipelines, and ends where one uninterrupted process
/// does.
#[test]
fn a_checkpoint_resumes_with_other_stages_and_replicas() {
    let dir = scratch("pipeline-resume");
    let run = |name: &str, ranks: usize, steps: usize, batch: usize, extra: &[&str]| {
        let mut args = base_steps(batch, steps);
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = dir.join(format!("{name}.safetensors"));
        args.extend(["--results".into(), dir.to_str().unwrap().into(), "--save-weights".into(), out.to_str().unwrap().into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        mpirun(ranks, &args).expect_ok();
        out
    };
    let reference = run("reference", 1, 6, 32, &["--micro-batches", "4"]);
    // 3 steps on 2 stages (momentum and weights in the checkpoint), then 3 more on 4 stages.
    let first = dir.join("ckpt-p4");
    let f = first.to_str().unwrap();
    run("first-half", 2, 3, 32, &["--pipeline-stages", "2", "--micro-batches", "4", "--partition", "params", "--checkpoint-dir", f, "--checkpoint-every", "3"]);
    assert_eq!(checkpoint_steps(&first), vec![3]);
    let second = dir.join("ckpt-d2");
    copy_dir(&first, &second);
    let p4 = run("resumed-p4", 4, 6, 32, &["--pipeline-stages", "4", "--micro-batches", "4", "--partition", "params", "--checkpoint-dir", f, "--resume"]);
    let diff = max_relative_difference(&reference, &p4);
    assert!(diff < 1e-6, "resumed on 4 stages: {diff:e}");
    // The same checkpoint taken up by two pipelines of two stages (16 samples each).
    let d2 = run("resumed-d2", 4, 6, 16, &["--pipeline-stages", "2", "--micro-batches", "2", "--partition", "params", "--checkpoint-dir", second.to_str().unwrap(), "--resume"]);
    let diff = max_relative_difference(&reference, &d2);
    assert!(diff < 1e-5, "resumed on 2 x 2: {diff:e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A study runs pipeline layouts beside plain data parallelism (`--stages`), and the report
/// gives each layout its column and a bubble table.
#[test]
fn a_study_with_stage_counts_and_its_report() {
    let dir = scratch("pipeline-study");
    let mut args: Vec<String> = ["study", "--ranks", "1,2", "--strategies", "ring", "--stages", "1,2", "--schedule", "gpipe", "--study-id", "pipe-study"].iter().map(|s| s.to_string()).collect();
    args.extend(base(32));
    args.extend(["--micro-batches".into(), "2".into(), "--results".into(), dir.to_str().unwrap().into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = mpirun(2, &args).expect_ok();
    assert!(run.stderr.contains("skipping 2 pipeline stage(s) at 1 rank(s)"), "{}", run.stderr);
    let runs = read_runs(&dir);
    let layouts: Vec<(u64, Option<u64>)> = runs.iter().map(|r| (r["ranks"].as_u64().unwrap(), r["pipeline"]["pipeline_stages"].as_u64())).collect();
    assert_eq!(layouts, vec![(1, None), (2, None), (2, Some(2))], "plain points stay plain (their micro-batches reset to 1)");
    let out = dir.join("report");
    hpc_train(&["report", "--input", dir.join("runs.jsonl").to_str().unwrap(), "--study", "pipe-study", "--out", out.to_str().unwrap()]).expect_ok();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| Ranks | Global batch | ring | ring (P=2, M=2 gpipe) |"), "{md}");
    assert!(md.contains("**Pipeline bubble**"), "{md}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn expect_refused(ranks: usize, extra: &[&str], message: &str) {
    let dir = scratch("pipeline-bad");
    let mut args = base(32);
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--results".into(), dir.to_str().unwrap().into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = mpirun(ranks, &args);
    assert!(!run.timed_out, "hung: {extra:?}\n{}", run.all_output());
    assert!(!run.ok(), "ran: {extra:?}\n{}", run.all_output());
    assert_eq!(run.stderr.matches(message).count(), 1, "{extra:?}: expected {message:?} once in\n{}", run.all_output());
    assert_eq!(run.stderr.lines().filter(|l| l.starts_with("error:")).count(), 1, "{extra:?}: one error line\n{}", run.stderr);
    assert!(!dir.join("runs.jsonl").exists(), "no record of a refused run");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pipeline that does not fit the ranks, launched: one error line, every rank non-zero, no
/// record. The other grids, schedules and micro-batch counts refused are unit tests
/// (src/train/plan.rs's layouts_whose_sizes_cannot_run_are_refused), so are partitions and
/// chunk counts the model cannot take (src/plan/pipeline.rs's), and what pipelines cannot run
/// with is the compatibility table's, refused in tests/conformance.rs's matrix.
#[test]
fn layouts_that_cannot_run_are_refused_with_one_line() {
    expect_refused(3, &["--pipeline-stages", "2"], "--pipeline-stages 2 does not divide the 3 ranks");
}

/// Zero-bubble schedules split each backward into B (the input's gradient, sent at once) and W
/// (the weights', deferred into the bubble); the weights' gradients still accumulate in
/// micro-batch order, so ZB-H1 and ZB-V (two chunks per stage in a V: stage 0 holds the first
/// and the last, and reads both images and labels) train to the weights of one process
/// accumulating the same micro-batches, on one pipeline and on two; ResNet-18 (batch norm,
/// residual joins, the graph's walk through every kind of layer) too.
#[test]
fn zero_bubble_schedules_train_the_weights_of_one_process() {
    let dir = scratch("pipeline-zero-bubble");
    // (ranks, schedule, stages, micro-batches). Under MPICH the rows whose messages differ in
    // kind: ZB-H1 on 3 stages, ZB-V (messages both ways on one link, and the turn of the V that
    // stays on its stage); the rest is the same arithmetic.
    let layouts = common::launcher::rows_under_mpich(
        &[(2, "zb-h1", 2, 1), (2, "zb-h1", 2, 4), (2, "zb-h1", 2, 8), (3, "zb-h1", 3, 8), (4, "zb-h1", 4, 4), (2, "zb-v", 2, 4), (2, "zb-v", 2, 8)],
        |(_, schedule, p, m)| (schedule == "zb-h1" && p == 3) || (schedule == "zb-v" && m == 4),
    );
    let mut sweep = Sweep::new(&dir);
    for (ranks, schedule, p, m) in layouts {
        let want = sweep.reference(32, m);
        let name = format!("p{p}-{schedule}-m{m}");
        let (ps, ms) = (p.to_string(), m.to_string());
        let got = sweep.train(&name, ranks, 32, &["--pipeline-stages", &ps, "--schedule", schedule, "--micro-batches", &ms, "--partition", "params"]);
        sweep.compare(name, &want, got, 1e-6);
    }
    // Two pipelines of 16 samples each against one process taking 32 in 4 micro-batches.
    let want = sweep.reference(32, 4);
    for schedule in ["zb-h1", "zb-v"] {
        let got = sweep.train(&format!("d2p2-{schedule}"), 4, 16, &["--pipeline-stages", "2", "--micro-batches", "2", "--schedule", schedule, "--partition", "params"]);
        sweep.compare(format!("D=2 x P=2 {schedule}"), &want, got, 1e-5);
    }
    let data_path = data().to_str().unwrap();
    let resnet = |sweep: &mut Sweep, name: &str, ranks: usize, extra: &[&str]| {
        let mut args = vec!["--model", "resnet18", "--data", data_path, "--steps", "2", "--batch-size", "16", "--threads", "1", "--no-eval", "--lr", "0.1", "--micro-batches", "4"];
        args.extend(extra);
        sweep.runs.add(name, ranks, &args)
    };
    let want = resnet(&mut sweep, "resnet-reference", 1, &[]);
    // The tiny CNN has 4 blocks: ZB-V on 3 and 4 stages (6 and 8 chunks) takes ResNet-18 (10);
    // ZB-H1 on 4 stages is the tiny CNN's row above. ZB-V at P = 2 is cut by time: its survey
    // runs every block's split backward, and the replay picks the cut.
    for (p, schedule) in common::launcher::rows_under_mpich(&[(2, "zb-h1"), (2, "zb-v"), (3, "zb-v"), (4, "zb-v")], |(p, _)| p == 3) {
        let ps = p.to_string();
        let partition = if (p, schedule) == (2, "zb-v") { "time" } else { "params" };
        let got = resnet(&mut sweep, &format!("resnet-p{p}-{schedule}"), p, &["--pipeline-stages", &ps, "--schedule", schedule, "--partition", partition]);
        sweep.compare(format!("resnet18 P={p} {schedule}"), &want, got, 1e-6);
    }
    sweep.check();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A large message moves only inside its sender's MPI calls where the MPI library has no
/// single-copy path between the ranks (Open MPI's shared memory without CMA, here forced off):
/// set-up measures that (a message whose sender makes no MPI call for 20 ms), the stages then
/// run a progress thread (src/progress.rs), the record and the log say so, and the weights
/// are still those of one process.
#[test]
fn stages_whose_messages_wait_for_their_sender_run_a_progress_thread() {
    if common::launcher::mpi() != common::launcher::Mpi::OpenMpi {
        eprintln!("skipped: forcing the single-copy path off is Open MPI's setting");
        return;
    }
    let dir = scratch("pipeline-progress");
    let mut args = base(32);
    args.extend(["--pipeline-stages", "2", "--micro-batches", "4", "--partition", "params"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (got, output) = train_saving_weights_env(&dir, "p2-no-single-copy", 2, &args, &[("OMPI_MCA_btl_vader_single_copy_mechanism", "none")]);
    assert!(output.contains("without MPI calls: a progress thread moves messages along"), "{output}");
    let record = read_runs(&dir).pop().unwrap();
    let pipeline = &record["pipeline"];
    assert_eq!(pipeline["progress_thread"], true, "{pipeline}");
    assert!(pipeline["stall_probe_ms"].as_f64().unwrap() >= 10.0, "{pipeline}");
    assert!(pipeline["stall_probe_bytes"].as_u64().unwrap() > 4096, "{pipeline}");
    let mut reference = base(32);
    reference.extend(["--micro-batches", "4"].map(String::from));
    let reference: Vec<&str> = reference.iter().map(String::as_str).collect();
    let want = train_saving_weights(&dir, "reference", 1, &reference);
    let diff = max_relative_difference(&want, &got);
    assert!(diff < 1e-6, "weights differ from one process by {diff:e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--overlap on` exchanges each chunk's buckets beside its last backward and steps them as they
/// are averaged: the weights of `--overlap off` with the same schedule (in practice bit for bit:
/// the same averages, computed earlier), on two pipelines of two stages; under interleaved,
/// stage 1 holds buckets of two chunks. Also with ZeRO 2 (each bucket's shard stepped as it is
/// reduced) and fp16 (its loss scaler sees every averaged gradient before the step). The record
/// carries the overlap's figures. One launch.
#[test]
fn overlap_gives_the_weights_of_no_overlap_with_every_unsplit_schedule() {
    let dir = scratch("pipeline-overlap");
    let interleaved = ["--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "4"];
    let rows: &[(&str, &[&str])] = &[
        ("gpipe", &["--schedule", "gpipe", "--micro-batches", "4"]),
        ("1f1b", &["--schedule", "1f1b", "--micro-batches", "4"]),
        ("interleaved", &interleaved),
        ("interleaved-zero2", &[&interleaved[..], &["--zero", "2"]].concat()),
        ("1f1b-fp16", &["--schedule", "1f1b", "--micro-batches", "4", "--precision", "fp16", "--loss-scale", "1024"]),
    ];
    // Under MPICH the schedule with two chunks' buckets per stage (the arithmetic is MPI's own).
    let rows = common::launcher::rows_under_mpich(rows, |(name, _)| name == "interleaved");
    let mut runs = Runs::new(&dir);
    let mut pairs = Vec::new();
    for (name, extra) in rows {
        let mut add = |mode: &str| {
            let mut args = base_steps(16, 3);
            // Buckets of about 1 KiB: several per stage.
            args.extend(["--pipeline-stages", "2", "--strategy", "ring", "--bucket-mb", "0.001", "--overlap", mode].map(String::from));
            args.extend(extra.iter().map(|s| s.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            runs.add(&format!("{name}-{mode}"), 4, &args)
        };
        pairs.push((name, add("off"), add("on")));
    }
    runs.launch();
    for (name, off, on) in &pairs {
        let diff = max_relative_difference(off, on);
        assert!(diff < 1e-5, "{name}: --overlap on differs from off by {diff:e}");
    }
    let records = read_runs(&dir);
    assert_eq!(records.len(), 2 * pairs.len());
    for r in &records {
        let on = r["extra"]["overlap_reason"] == "--overlap on";
        assert_eq!(r["extra"]["overlap"], on, "{}", r["extra"]);
        if on {
            assert!(r["extra"]["overlap_buckets"].as_u64().is_some_and(|b| b >= 1), "{}", r["extra"]);
            assert!(r["extra"]["exchange_total_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{}", r["extra"]);
            assert!(r["extra"]["exchange_hidden_share"].as_f64().is_some(), "{}", r["extra"]);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--zero 3` in a pipeline shards each stage's parameters, gradients and optimizer state over
/// the stage's replicas (gathered once per step for all its micro-batches, reduce-scattered
/// after the schedule): every schedule, hybrid sharding over nodes, LARS, fp16, ResNet-18's
/// batch norm channels-last with evaluation, and checkpoints resumed across stage 3 and
/// data parallelism train to the weights of the same pipelines at `--zero 0`. The average a
/// reduce-scatter leaves a shard is the ring all-reduce's own first half, and the optimizer
/// steps the same values in pieces of a shard instead of whole tensors, so the weights are
/// equal up to the rounding of those kernels (measured: at most 1.7e-9 relative, most runs
/// identical; results/issue68-zero3-pipeline/). The bound of 1e-5 holds on any x86-64 CPU,
/// whose f32 operations round alike under IEEE 754.
#[test]
fn zero_3_shards_each_stage_over_its_replicas_and_trains_to_the_weights_of_zero_0() {
    let dir = scratch("pipeline-zero3");
    let folder = |name: &str| leak(dir.join(name).to_str().unwrap());
    // A folder per resume: a resumed run writes its own checkpoint at its end, which the next
    // resume from the same folder would find and have nothing to train.
    let (c0, c3, c3_units) = (folder("zero0-checkpoints"), folder("zero3-checkpoints"), folder("zero3-checkpoints-for-units"));
    const ONE_F_ONE_B: [&str; 4] = ["--schedule", "1f1b", "--micro-batches", "4"];
    // (name, options of both runs, options of the stage-3 run alone)
    let rows: &[(&str, &[&str], &[&str])] = &[
        ("gpipe", &["--schedule", "gpipe", "--micro-batches", "4"], &[]),
        ("1f1b", &ONE_F_ONE_B, &[]),
        // Each replica on a node of its own (the launch's hook): the stage's shards are cut over
        // one rank per node and kept on both, whose shards are all-reduced across the nodes.
        ("interleaved-hybrid", &["--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "4"], &["--fsdp-hybrid"]),
        ("zb-h1", &["--schedule", "zb-h1", "--micro-batches", "4"], &[]),
        ("zb-v", &["--schedule", "zb-v", "--micro-batches", "4"], &[]),
        ("1f1b-lars", &["--schedule", "1f1b", "--micro-batches", "4", "--optimizer", "lars", "--lr", "1"], &[]),
        ("1f1b-fp16", &["--schedule", "1f1b", "--micro-batches", "4", "--precision", "fp16", "--loss-scale", "1024"], &[]),
    ];
    let one_f_one_b = ONE_F_ONE_B;
    let mut runs = Runs::new(&dir);
    let mut compared: Vec<(String, PathBuf, PathBuf)> = Vec::new();
    // The tiny CNN at a rate of 0.01 (a row's own --lr replaces it), over the ring.
    let add = |runs: &mut Runs, name: &str, steps: usize, batch: usize, extra: &[&str]| {
        let mut args = base_steps(batch, steps);
        let lr = extra.iter().position(|a| *a == "--lr").map_or("0.01", |at| extra[at + 1]);
        let at = args.iter().position(|a| a == "--lr").unwrap();
        args[at + 1] = lr.to_string();
        args.extend(["--strategy", "ring"].map(String::from));
        let mut rest = extra.iter();
        while let Some(a) = rest.next() {
            match *a {
                "--lr" => drop(rest.next()),
                other => args.push(other.to_string()),
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        runs.add(name, 4, &args)
    };
    // Cut by the parameters' count, not by timing (the default): every run of the same
    // schedule cuts alike, so that their records' memory figures compare.
    let pipelined = |extra: &[&str]| -> Vec<&'static str> { [&["--pipeline-stages", "2", "--partition", "params"][..], extra].concat().into_iter().map(leak).collect() };
    for (name, both, sharded) in rows {
        let reference = add(&mut runs, &format!("{name}-zero0"), 3, 16, &pipelined(both));
        let zero3 = add(&mut runs, &format!("{name}-zero3"), 3, 16, &pipelined(&[both, &["--zero", "3"][..], sharded].concat()));
        compared.push((name.to_string(), reference, zero3));
    }
    // ResNet-18's batch norm, channels-last, with the evaluation at the run's end.
    let resnet = |zero: &str| {
        let a = ["--model", "resnet18", "--channels-last", "--pipeline-stages", "2", "--partition", "params", "--schedule", "1f1b", "--micro-batches", "2", "--zero", zero];
        let mut args = base_steps(8, 2);
        args.retain(|a| a != "--no-eval");
        let at = args.iter().position(|a| a == "--model").unwrap();
        args.drain(at..at + 2);
        let at = args.iter().position(|a| a == "--lr").unwrap();
        args[at + 1] = "0.01".into();
        args.extend(a.map(String::from));
        args
    };
    let resnet_runs: Vec<PathBuf> = ["0", "3"]
        .iter()
        .map(|zero| {
            let args = resnet(zero);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            runs.add(&format!("resnet18-zero{zero}"), 4, &args)
        })
        .collect();
    compared.push(("resnet18 channels-last".into(), resnet_runs[0].clone(), resnet_runs[1].clone()));
    // Checkpoints at step 2 of 3, resumed in another layout for the last step: stage 3 in a
    // pipeline to --zero 0 and to stage 3's units without a pipeline (4 replicas of 8 samples:
    // the same global batch), and --zero 0 to stage 3 in a pipeline.
    let reference = compared.iter().find(|(n, ..)| n == "1f1b").map(|(_, r, _)| r.clone()).expect("the 1f1b row runs under every MPI");
    for (name, folder) in [("zero3-first-two", c3), ("zero3-first-two-again", c3_units)] {
        add(&mut runs, name, 2, 16, &pipelined(&[&one_f_one_b[..], &["--zero", "3", "--checkpoint-dir", folder]].concat()));
    }
    add(&mut runs, "zero0-first-two", 2, 16, &pipelined(&[&one_f_one_b[..], &["--checkpoint-dir", c0]].concat()));
    let resumed: [(&str, &str, Vec<&str>, usize); 3] = [
        ("zero 3 resumed at zero 0", c3, pipelined(&one_f_one_b), 16),
        ("zero 3 resumed as units", c3_units, vec!["--zero", "3"], 8),
        ("zero 0 resumed at zero 3", c0, pipelined(&[&one_f_one_b[..], &["--zero", "3"]].concat()), 16),
    ];
    for (name, folder, layout, batch) in resumed {
        let weights = add(&mut runs, &name.replace(' ', "-"), 3, batch, &[&layout[..], &["--checkpoint-dir", folder, "--resume"]].concat());
        compared.push((name.into(), reference.clone(), weights));
    }
    runs.launch_env(&[("HPC_TRAIN_RANKS_PER_NODE", "1")]);
    for (name, reference, weights) in &compared {
        let diff = max_relative_difference(reference, weights);
        assert!(diff < 1e-5, "{name} ({}) differs from --zero 0 by {diff:e}", weights.display());
    }
    let records = read_runs(&dir);
    let find = |zero: u64, schedule: &str, steps: u64| {
        records
            .iter()
            .find(|r| r["extra"]["zero"] == zero && r["pipeline"]["schedule"] == schedule && r["steps"] == steps && r["model"] == "tiny" && r["optimizer"] == "sgd" && r["extra"]["precision"] != "fp16")
            .unwrap_or_else(|| panic!("zero {zero} {schedule} of {steps} steps in {records:#?}"))
    };
    // Stage 3 holds half of each stage's parameters and optimizer state between steps (D = 2),
    // gathers the whole stage once per step, and says why it does not overlap.
    let (plain, sharded) = (find(0, "1f1b", 3), find(3, "1f1b", 3));
    let bytes = |r: &serde_json::Value, key: &str| r["extra"][key].as_u64().unwrap_or_else(|| panic!("{key} in {}", r["extra"])) as f64;
    let state = bytes(sharded, "optimizer_state_bytes") / bytes(plain, "optimizer_state_bytes");
    assert!((state - 0.5).abs() < 0.01, "{state} of --zero 0's optimizer state");
    let held = bytes(sharded, "parameter_bytes_held") / bytes(sharded, "peak_gathered_parameter_bytes");
    assert!((held - 0.5).abs() < 0.01, "{held}: held between steps against gathered");
    assert_eq!(sharded["extra"]["fsdp_gathers"], 3, "one gather per step: {}", sharded["extra"]);
    assert_eq!(sharded["extra"]["fsdp_buffer_bytes"], 0, "the gathered stage's buffer kept between steps: {}", sharded["extra"]);
    assert_eq!(sharded["extra"]["overlap"], false);
    assert_eq!(sharded["parameters"], plain["parameters"], "the record counts the stages' parameters, not the empty tensors between steps");
    assert_eq!(records.iter().filter(|r| r["extra"]["resumed_from_step"].as_u64() == Some(2)).count(), 3);
    // The evaluation through the gathered stages scores as --zero 0's.
    let evaluated: Vec<&serde_json::Value> = records.iter().filter(|r| r["model"] == "resnet18").collect();
    assert_eq!(evaluated.len(), 2);
    assert_same_evaluation("zero 3", evaluated[1], evaluated[0], 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}
