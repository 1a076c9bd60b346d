//! Mixed precision (`--precision bf16|fp16`) on CPU ranks, in every layout: a bf16 pipeline
//! (with and without recomputation) and `--zero 3` compute their steps as one bf16 process does,
//! and every layout evaluates in fp32; fp16 tensor-parallel ranks skip an overflow of one rank's
//! slice together, fp16 pipeline stages one stage's overflow, and ZeRO 1/2/3's ranks one rank's
//! overflow; LARS under tensor parallelism takes the whole layers' norms; tf32 on the CPU
//! is refused by name.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// The tiny CNN's data: 128 samples of 1x16x16 in 10 classes (an epoch of 4 steps of 32).
fn cnn_data(dir: &Path) -> PathBuf {
    synth(dir, "cnn", 128, 64, "1x16x16", 10)
}

/// vit-tiny's data, as tests/tensor.rs makes it.
fn vit_data(dir: &Path) -> PathBuf {
    synth(dir, "vit", 96, 40, "1x16x16", 4)
}

/// The tiny CNN for an epoch (4 steps of 32 samples, split over the data-parallel ranks).
fn cnn_args<'a>(data: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--model", "tiny", "--data", data, "--scaling", "strong", "--global-batch", "32", "--epochs", "1", "--threads", "1", "--log-every", "1000", "--lr", "0.1"];
    a.extend(extra);
    a
}

fn vit_args<'a>(data: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--model", "vit-tiny", "--data", data, "--scaling", "strong", "--global-batch", "16", "--steps", "4",
        "--threads", "1", "--log-every", "1000", "--warmup-steps", "1", "--no-eval",
    ];
    a.extend(extra);
    a
}

/// Every training forward autocasts alike: a bf16 pipeline of 2 stages (1F1B, and GPipe
/// recomputing its forwards) ends with the weights of one bf16 process accumulating the same
/// micro-batches, and --zero 3 with those of the plain exchange, both far closer than bf16 is to
/// fp32 (the pipeline had computed in fp32 while its record said bf16). Evaluation is fp32 in
/// every layout: --zero 3's test loss is the plain run's (it had evaluated under autocast, to
/// 2.578 against 2.590). One process with micro-batches runs the pipeline's executor too: before,
/// its "bf16" weights were fp32's, which the first check catches.
#[test]
fn every_layout_computes_a_bf16_step_as_one_bf16_process() {
    let dir = scratch("precision-bf16");
    let data = cnn_data(&dir);
    let d = data.to_str().unwrap();
    let no_eval = |extra: &[&'static str]| -> Vec<&'static str> { [&["--no-eval"][..], extra].concat() };
    // Every run in one launch (common::Runs). Records come in the order the runs were added,
    // which is by rank count, as Runs launches them under MPICH (one launch per count).
    let mut runs = Runs::new(&dir);
    let mut names = Vec::new();
    let mut add = |name: &'static str, ranks: usize, args: Vec<&str>| {
        names.push(name);
        runs.add(name, ranks, &args)
    };
    let reference = add("one-bf16-m4", 1, cnn_args(d, &no_eval(&["--precision", "bf16", "--micro-batches", "4"])));
    let fp32 = add("one-fp32-m4", 1, cnn_args(d, &no_eval(&["--micro-batches", "4"])));
    let pipelined = ["--precision", "bf16", "--pipeline-stages", "2", "--micro-batches", "4", "--partition", "params"];
    let layouts: Vec<(&str, PathBuf)> = [("p2-1f1b", vec!["--schedule", "1f1b"]), ("p2-gpipe-recompute", vec!["--schedule", "gpipe", "--recompute"])]
        .into_iter()
        .map(|(name, extra)| {
            let args: Vec<&str> = pipelined.iter().copied().chain(extra).collect();
            (name, add(name, 2, cnn_args(d, &no_eval(&args))))
        })
        .collect();
    // --zero 3 on 2 ranks against the plain exchange on 2 ranks, both bf16, with the
    // evaluation at the epoch's end.
    let plain = add("d2-bf16", 2, cnn_args(d, &["--precision", "bf16", "--strategy", "ring"]));
    let sharded = add("d2-zero3-bf16", 2, cnn_args(d, &["--precision", "bf16", "--strategy", "ring", "--zero", "3"]));
    runs.launch();
    let records = read_runs(&dir);
    assert_eq!(records.len(), names.len(), "one record per run");
    let record = |name: &str| records[names.iter().position(|n| *n == name).unwrap()].clone();

    // Autocast ran on the CPU: bf16 is far from fp32 (1e-3 and more after 4 steps).
    let bf16_to_fp32 = max_relative_difference(&fp32, &reference);
    assert!(bf16_to_fp32 > 1e-4, "bf16 gave fp32's weights ({bf16_to_fp32:e}): autocast did not run");
    for (name, got) in &layouts {
        let diff = max_relative_difference(&reference, got);
        // The same bf16 operations per micro-batch; activations cross stages in f32, which
        // holds a bf16 value exactly.
        assert!(diff < 1e-5 && diff * 100.0 < bf16_to_fp32, "{name} bf16: {diff:e} from one bf16 process (fp32 is {bf16_to_fp32:e} away)");
        assert_eq!(record(name)["extra"]["precision"], "bf16");
    }

    let (plain_record, sharded_record) = (record("d2-bf16"), record("d2-zero3-bf16"));
    let diff = max_relative_difference(&plain, &sharded);
    assert!(diff < 1e-5, "--zero 3 bf16: {diff:e} from the plain exchange's bf16 weights");
    let (loss, want) = (sharded_record["test_loss"].as_f64().unwrap(), plain_record["test_loss"].as_f64().unwrap());
    assert!((loss - want).abs() < 1e-5 * want.abs(), "--zero 3 evaluated to {loss}, the plain run to {want}: not both in fp32");
    assert_eq!(sharded_record["test_accuracy"], plain_record["test_accuracy"]);

    // TF32 is a GPU's: a CPU run that asks for it is refused, not run in fp32 under its name.
    let run = hpc_train(&cnn_args(d, &["--precision", "tf32", "--results", dir.to_str().unwrap()]));
    assert!(!run.ok() && run.all_output().contains("--precision tf32: TF32 is a mode of NVIDIA GPUs' matrix units"), "{}", run.all_output());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// fp16 with --tensor-parallel 2: rank 1's gradients overflow alone at step 1 (the `infgrad`
/// fault); both ranks skip that step and halve the scale, as one process whose gradients
/// overflow there does. Rank 0 had stepped alone, its copies of the whole tensors parting
/// from rank 1's (O(1) away from the reference; 1.7 without the skip).
#[test]
fn fp16_tensor_parallel_ranks_skip_an_overflow_together() {
    let dir = scratch("precision-fp16-tp");
    let data = vit_data(&dir);
    let d = data.to_str().unwrap();
    let (reference, one_log) = train_saving_weights_env(&dir, "one-fp16", 1, &vit_args(d, &["--precision", "fp16"]), &[("HPC_TRAIN_FAULT", "infgrad@0:1")]);
    assert_eq!(one_log.matches("gradients overflowed at step 1;").count(), 1, "{one_log}");
    let (t2, log) = train_saving_weights_env(&dir, "t2-fp16", 2, &vit_args(d, &["--precision", "fp16", "--tensor-parallel", "2"]), &[("HPC_TRAIN_FAULT", "infgrad@1:1")]);
    // Rank 0 logs the skip: it skipped with rank 1.
    assert_eq!(log.matches("gradients overflowed at step 1;").count(), 1, "{log}");
    let diff = max_relative_difference(&reference, &t2);
    // fp16 rounds each rank's partial sums of a row-parallel layer before they are added: the
    // patch embedding's bias ends 1.3e-3 away after 4 steps (a step more or less is O(1)).
    assert!(diff < 1e-2, "fp16 T = 2: {diff:e} from one fp16 process");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// fp16 through a pipeline of 2 stages (1F1B): the loss scaler's scale reaches every stage's
/// gradients, and an overflow on the second stage alone (the `infgrad` fault on rank 1 at
/// step 1) makes both stages skip that step and halve the scale, as one fp16 process whose
/// gradients overflow there does. Without the agreement the first stage steps alone and its weights part
/// from the reference by a whole step's update. The one process runs the same micro-batches
/// (its forwards are the stages' forwards, in the same order: activations cross stages in f32,
/// which holds an fp16 value exactly), so the pipeline is compared tightly, far inside fp16's
/// distance from fp32; that process is compared with the plain fp16 step (no micro-batches, the
/// step the scaler was first written for) within fp16 rounding of sums taken in another order.
/// Two such pipelines at `--zero 3` skip together as at `--zero 0`.
#[test]
fn fp16_pipeline_stages_skip_an_overflow_together() {
    let dir = scratch("precision-fp16-pipeline");
    let data = cnn_data(&dir);
    let d = data.to_str().unwrap();
    let fp16 = ["--no-eval", "--precision", "fp16", "--loss-scale", "1024"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> { fp16.iter().chain(extra).copied().collect() };
    // Rank 0 at step 1 in one process; rank 1, the second stage, in the pipeline.
    let (rank0, rank1) = ([("HPC_TRAIN_FAULT", "infgrad@0:1")], [("HPC_TRAIN_FAULT", "infgrad@1:1")]);
    let (plain, plain_log) = train_saving_weights_env(&dir, "one-fp16", 1, &cnn_args(d, &with(&[])), &rank0);
    let (reference, one_log) = train_saving_weights_env(&dir, "one-fp16-m4", 1, &cnn_args(d, &with(&["--micro-batches", "4"])), &rank0);
    let fp32 = train_saving_weights(&dir, "one-fp32-m4", 1, &cnn_args(d, &["--no-eval", "--micro-batches", "4"]));
    let pipelined = with(&["--pipeline-stages", "2", "--micro-batches", "4", "--partition", "params", "--schedule", "1f1b"]);
    let (p2, log) = train_saving_weights_env(&dir, "p2-fp16", 2, &cnn_args(d, &pipelined), &rank1);
    for (name, log) in [("one process", &plain_log), ("one process, micro-batches", &one_log), ("2 stages", &log)] {
        assert_eq!(log.matches("gradients overflowed at step 1;").count(), 1, "{name}: {log}");
    }
    let fp16_to_fp32 = max_relative_difference(&fp32, &reference);
    assert!(fp16_to_fp32 > 1e-4, "fp16 gave fp32's weights ({fp16_to_fp32:e}): autocast did not run");
    let diff = max_relative_difference(&reference, &p2);
    assert!(diff < 1e-5 && diff * 100.0 < fp16_to_fp32, "fp16 P = 2: {diff:e} from one fp16 process (fp32 is {fp16_to_fp32:e} away)");
    let diff = max_relative_difference(&plain, &reference);
    assert!(diff < 1e-2, "fp16 with micro-batches: {diff:e} from the plain fp16 step");
    // Two pipelines at --zero 3 (each stage sharded over its 2 replicas; pipeline_step.rs):
    // rank 1's overflow skips the step on all four ranks, as at --zero 0. Only the averages
    // differ (a reduce-scatter against the ring's all-reduce, each a sum of 2).
    let replicated: Vec<&str> = pipelined.iter().copied().chain(["--strategy", "ring"]).collect();
    let sharded: Vec<&str> = replicated.iter().copied().chain(["--zero", "3"]).collect();
    let (d2, d2_log) = train_saving_weights_env(&dir, "d2-p2-fp16", 4, &cnn_args(d, &replicated), &rank1);
    let (d2_zero3, d2_zero3_log) = train_saving_weights_env(&dir, "d2-p2-zero3-fp16", 4, &cnn_args(d, &sharded), &rank1);
    for (name, log) in [("2 pipelines", &d2_log), ("2 pipelines at --zero 3", &d2_zero3_log)] {
        assert_eq!(log.matches("gradients overflowed at step 1;").count(), 1, "{name}: {log}");
    }
    let diff = max_relative_difference(&d2, &d2_zero3);
    assert!(diff < 1e-5 && diff * 100.0 < fp16_to_fp32, "fp16 D = 2, P = 2 at --zero 3: {diff:e} from --zero 0");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// fp16 with ZeRO 1, 2 and 3 on 2 ranks: rank 1's gradients overflow alone at step 1 (the
/// `infgrad` fault); both ranks skip that step and halve the scale, as the plain exchange's
/// ranks do, and every other step unscales the shards as the plain step unscales the averaged
/// gradients. Each rank steps its own shard, so without the agreement rank 0 steps its shard
/// alone and the weights part from the reference by a step's update. The ranks compute the
/// same fp16 forwards and backwards in both (same weights, same samples); only the averages
/// differ, ZeRO's reduce-scatter against the ring's all-reduce, by f32 rounding: hence 1e-5,
/// far inside fp16's distance from fp32 (checked, so that the autocast ran).
#[test]
fn fp16_zero_ranks_skip_an_overflow_together() {
    let dir = scratch("precision-fp16-zero");
    let data = cnn_data(&dir);
    let d = data.to_str().unwrap();
    let fault = [("HPC_TRAIN_FAULT", "infgrad@1:1")];
    let fp16 = ["--no-eval", "--precision", "fp16", "--loss-scale", "1024", "--strategy", "ring"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> { fp16.iter().chain(extra).copied().collect() };
    let (reference, log) = train_saving_weights_env(&dir, "ring-fp16", 2, &cnn_args(d, &with(&[])), &fault);
    assert_eq!(log.matches("gradients overflowed at step 1;").count(), 1, "{log}");
    let fp32 = train_saving_weights(&dir, "ring-fp32", 2, &cnn_args(d, &["--no-eval", "--strategy", "ring"]));
    let fp16_to_fp32 = max_relative_difference(&fp32, &reference);
    assert!(fp16_to_fp32 > 1e-4, "fp16 gave fp32's weights ({fp16_to_fp32:e}): autocast did not run");
    for zero in ["1", "2", "3"] {
        let (got, log) = train_saving_weights_env(&dir, &format!("zero{zero}-fp16"), 2, &cnn_args(d, &with(&["--zero", zero])), &fault);
        assert_eq!(log.matches("gradients overflowed at step 1;").count(), 1, "--zero {zero}: {log}");
        let diff = max_relative_difference(&reference, &got);
        assert!(diff < 1e-5 && diff * 100.0 < fp16_to_fp32, "fp16 --zero {zero}: {diff:e} from the plain exchange (fp32 is {fp16_to_fp32:e} away)");
    }
    // The records say how many steps the scaler skipped (the fp16 runs: one each; fp32: none).
    let skipped: Vec<Option<u64>> = read_runs(&dir).iter().map(|r| r["extra"]["fp16_skipped_steps"].as_u64()).collect();
    assert_eq!(skipped, [Some(1), None, Some(1), Some(1), Some(1)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// LARS's trust ratio under --tensor-parallel 2 (and 2 stages of groups) is the whole layer's:
/// each rank's squared norms of its parts are summed over the group, its copies of whole
/// tensors counted once. Measured: 6.4e-7 from one rank at T = 2; each part's own ratio, as it
/// had been, ended 3.9e-5 away.
#[test]
fn lars_under_tensor_parallelism_takes_whole_layers_norms() {
    let dir = scratch("precision-lars-tp");
    let data = vit_data(&dir);
    let d = data.to_str().unwrap();
    let reference = train_saving_weights(&dir, "one-lars", 1, &vit_args(d, &["--optimizer", "lars"]));
    let cases: [(&str, usize, &[&str]); 2] = [
        ("t2", 2, &["--tensor-parallel", "2"]),
        ("p2-t2", 4, &["--tensor-parallel", "2", "--pipeline-stages", "2", "--micro-batches", "4", "--partition", "params"]),
    ];
    for (name, ranks, extra) in cases {
        let args: Vec<&str> = ["--optimizer", "lars"].iter().chain(extra).copied().collect();
        let got = train_saving_weights(&dir, name, ranks, &vit_args(d, &args));
        let diff = max_relative_difference(&reference, &got);
        assert!(diff < 1e-5, "LARS {name}: {diff:e} from one rank");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
