//! Tensor parallelism (`--tensor-parallel T`, Megatron's split of a transformer's heads and MLP):
//! vit-tiny trained with T = 2 and 4, D x T = 2 x 2, P x T = 2 x 2 and D x P x T = 2 x 2 x 2
//! ends with the weights of one rank;
//! the evaluation gives one rank's test loss; the record's all-reduce counts match the formula
//! (4 per encoder layer and step, of batch x tokens x width); checkpoints resume in another
//! layout; ZeRO 1, 2 and 3 shard the parts over their replicas and train alike; a group
//! spanning nodes warns and still trains alike; what it cannot do is refused by name.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// 16x16 images in 4x4 patches: 16 patches and the class token, 17 tokens.
const TOKENS: u64 = 17;
/// vit-tiny: 4 encoder layers of width 64, 4 heads, an MLP of 128.
const LAYERS: u64 = 4;
const WIDTH: u64 = 64;

fn dataset(dir: &Path) -> PathBuf {
    synth(dir, "vit", 96, 40, "1x16x16", 4)
}

fn args<'a>(data: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--model", "vit-tiny", "--data", data, "--scaling", "strong", "--global-batch", "16", "--steps", steps,
        "--threads", "1", "--log-every", "1000", "--warmup-steps", "1",
    ];
    a.extend(extra);
    a
}

/// T = 2 and 4 (each all-reduce), D x T = 2 x 2, pipelines of groups (P x T = 2 x 2 with
/// 1F1B, D x P x T = 2 x 2 x 2 with GPipe, at --zero 0 and 3, and stage 3's 3D checkpoint
/// resumed at --zero 0), and AdamW at T = 2, against one rank; the record's figures of the
/// group's all-reduces and of the part each rank holds.
#[test]
fn tensor_parallel_trains_to_the_weights_of_one_rank() {
    let dir = scratch("tensor-equal");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    // 6 steps: the epoch's end (96 / 16), so the evaluation runs too. Longer, the model itself
    // amplifies f32 rounding: at 12 steps one rank with 2 threads differs from one with 1 by
    // 2.8e-5, T = 2 by 3.9e-5 (results/tensor-parallel/README.md).
    // Every run in one launch (common::Runs), then the comparisons.
    let mut runs = Runs::new(&dir);
    let reference = runs.add("one-rank", 1, &args(d, "6", &[]));
    let reference_adamw = runs.add("one-rank-adamw", 1, &args(d, "6", &["--optimizer", "adamw", "--lr", "0.001", "--no-eval"]));
    let pipelined = ["--pipeline-stages", "2", "--micro-batches", "4", "--partition", "params"];
    let p2t2: Vec<&str> = ["--tensor-parallel", "2"].iter().chain(&pipelined).copied().collect();
    let d2p2t2: Vec<&str> = ["--tensor-parallel", "2", "--strategy", "ring", "--schedule", "gpipe"].iter().chain(&pipelined).copied().collect();
    // 3D with stage 3: each stage's parts sharded over its D replicas (pipeline_step.rs), and
    // its checkpoint, written after 3 steps, resumed at --zero 0 (on 8 ranks as well: under
    // MPICH each rank count is a launch of its own, and the resume must follow its checkpoint).
    let d2p2t2_zero3: Vec<&str> = d2p2t2.iter().copied().chain(["--zero", "3"]).collect();
    let zero3_checkpoints = leak(dir.join("d2-p2-t2-zero3-checkpoints").to_str().unwrap());
    runs.add("d2-p2-t2-zero3-first-three", 8, &args(d, "3", &[&d2p2t2_zero3[..], &["--checkpoint-dir", zero3_checkpoints, "--no-eval"]].concat()));
    let cases: [(&str, usize, Vec<&str>, &PathBuf); 10] = [
        ("t2", 2, vec!["--tensor-parallel", "2"], &reference),
        ("t2-ring", 2, vec!["--tensor-parallel", "2", "--tp-allreduce", "ring"], &reference),
        ("t4-rhd", 4, vec!["--tensor-parallel", "4", "--tp-allreduce", "rhd"], &reference),
        ("t4", 4, vec!["--tensor-parallel", "4"], &reference),
        ("d2-t2", 4, vec!["--tensor-parallel", "2", "--strategy", "ring"], &reference),
        ("p2-t2", 4, p2t2, &reference),
        ("d2-p2-t2", 8, d2p2t2.clone(), &reference),
        ("d2-p2-t2-zero3", 8, d2p2t2_zero3, &reference),
        ("d2-p2-t2-resumed-from-zero3", 8, d2p2t2.iter().copied().chain(["--checkpoint-dir", zero3_checkpoints, "--resume"]).collect(), &reference),
        ("t2-adamw", 2, vec!["--tensor-parallel", "2", "--optimizer", "adamw", "--lr", "0.001", "--no-eval"], &reference_adamw),
    ];
    let trained: Vec<PathBuf> = cases.iter().map(|(name, ranks, extra, _)| runs.add(name, *ranks, &args(d, "6", extra))).collect();
    runs.launch();
    for ((name, _, _, against), weights) in cases.iter().zip(trained) {
        if name.ends_with("adamw") {
            // The key bias's gradient is zero in exact arithmetic (softmax ignores what is added
            // to every key's score alike), so in f32 it is rounding noise, which Adam scales to
            // full steps: one rank with 2 threads differs from 1 thread by 2.7e-4 there, and
            // MPI_Allreduce over 2 ranks by 3.1e-4. Every other tensor is compared.
            let (a, b) = (read_weights(against), read_weights(&weights));
            for ((name_a, va), (_, vb)) in a.iter().zip(&b).filter(|((n, _), _)| !n.ends_with("in_proj_bias")) {
                let diff: f64 = va.iter().zip(vb).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
                let norm: f64 = va.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
                assert!(diff / norm < 1e-5, "{name}: {name_a} differs from one rank by {:e}", diff / norm);
            }
            continue;
        }
        let diff = max_relative_difference(against, &weights);
        assert!(diff < 1e-5, "{name} differs from one rank by {diff:e}");
    }

    let runs = read_runs(&dir);
    assert_eq!(runs.iter().filter(|r| r["extra"]["resumed_from_step"].as_u64() == Some(3)).count(), 1, "the resume from stage 3's 3D checkpoint");
    let one = runs.iter().find(|r| r["ranks"] == 1 && r["extra"]["optimizer_state_bytes"].as_u64().is_some() && r["optimizer"] == "sgd").expect("the one-rank run");
    let params = one["extra"]["parameters"].as_u64().unwrap();
    for r in runs.iter().filter(|r| r["extra"]["tensor_parallel"].as_u64().is_some()) {
        let extra = &r["extra"];
        let get = |key: &str| extra[key].as_u64().unwrap_or_else(|| panic!("{key} in {r}"));
        let (t, ranks) = (get("tensor_parallel"), r["ranks"].as_u64().unwrap());
        let p = r["pipeline"]["pipeline_stages"].as_u64().unwrap_or(1);
        assert_eq!(extra["layout"], serde_json::json!({ "data": ranks / t / p, "pipeline": p, "tensor": t }), "{r}");
        assert_eq!(r["workers"].as_u64().unwrap(), ranks / t / p, "a pipeline of groups is one worker: {r}");
        assert_eq!(get("parameters"), params, "the whole model's count: {r}");
        // Each group's batch: the global batch over the D replicas (the last step is full: 96 = 6 x 16).
        let batch = 16 / (ranks / t / p);
        assert_eq!(r["batch_per_rank"].as_u64().unwrap(), batch, "{r}");
        // Two all-reduces in forward and two in backward per encoder layer (rank 0's: those of
        // its stage, 2 of the 4 layers cut by parameters, each micro-batch apart).
        let (layers, micro_batches) = if p == 1 { (LAYERS, 1) } else { (2, 4) };
        assert_eq!(get("tp_allreduce_calls"), 4 * layers * micro_batches, "{r}");
        assert_eq!(get("tp_allreduce_elements"), 4 * layers * batch * TOKENS * WIDTH, "{r}");
        // Each rank sends 2(T-1)/T of every buffer (ring and recursive halving alike).
        let sent = extra["tp_bytes_sent"].as_f64().unwrap();
        let expected = (4 * get("tp_allreduce_elements")) as f64 * 2.0 * (t - 1) as f64 / t as f64;
        assert!((sent - expected).abs() <= 1.0, "{sent} against {expected}: {r}");
        assert!(extra["tp_allreduce_ms"].as_f64().unwrap() > 0.0, "{r}");
        // The part each rank holds: per layer 4 x 64 (layer norms) + 64 + 64 (the two biases
        // added after the sums) whole, the rest (3 x 64 x 64 + 3 x 64 + 64 x 64 + 64 x 128 + 128
        // + 128 x 64 = 37,056) cut in T.
        let whole_per_layer = 4 * 64 + 64 + 64;
        let cut_per_layer = 3 * 64 * 64 + 3 * 64 + 64 * 64 + 64 * 128 + 128 + 128 * 64;
        assert!(whole_per_layer + cut_per_layer < params, "{r}");
        if p == 1 {
            let held = params - LAYERS * cut_per_layer * (t - 1) / t;
            assert_eq!(get("parameter_bytes_held"), 4 * held, "{r}");
            assert_eq!(get("optimizer_state_bytes"), if r["optimizer"] == "adamw" { 8 * held } else { 4 * held }, "{r}");
        } else {
            // A stage: the embedding or the head with 2 layers, each layer's part; under
            // --zero 3 gathered for each step, and half of it held between steps (D = 2).
            let stage_bytes = match get("zero") {
                3 => {
                    let (held, gathered) = (get("parameter_bytes_held") as f64, get("peak_gathered_parameter_bytes"));
                    assert!((held / gathered as f64 - 0.5).abs() < 0.01, "{held} held of {gathered} gathered: {r}");
                    gathered
                }
                _ => get("parameter_bytes_held"),
            };
            let held = stage_bytes / 4;
            assert!(held < params / 2 && held > 2 * (whole_per_layer + cut_per_layer / t), "{r}");
        }
    }
    // The evaluation: every group's ranks see the same samples, counted once.
    let evaluated: Vec<&serde_json::Value> = runs.iter().filter(|r| r["test_loss"].as_f64().is_some()).collect();
    assert_eq!(evaluated.len(), 10, "{evaluated:#?}");
    for r in &evaluated {
        let (loss, reference) = (r["test_loss"].as_f64().unwrap(), one["test_loss"].as_f64().unwrap());
        assert!((loss - reference).abs() < 1e-4 * reference.abs(), "test loss {loss} against {reference}: {r}");
        assert_eq!(r["test_accuracy"], one["test_accuracy"], "{r}");
    }
}

/// A tensor-parallel run's checkpoints (each rank writes its rectangles of the cut tensors, the
/// group's whole copies once; nothing glued): stopped after 3 of 6 steps at T = 2, it resumes at T = 2, on one rank and at T = 4, and a
/// one-rank checkpoint resumes at T = 2 (the momentum cut like the weights); each ends within
/// 1e-5 of the uninterrupted one-rank run.
#[test]
fn tensor_parallel_checkpoints_are_whole_and_resume_in_any_layout() {
    let dir = scratch("tensor-checkpoints");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let r = dir.to_str().unwrap();
    let reference = train_saving_weights(&dir, "one-rank", 1, &args(d, "6", &["--no-eval"]));
    for (name, first_ranks, first_t, then_ranks, then_t) in [("t2-t2", 2, "2", 2, "2"), ("t2-one", 2, "2", 1, "1"), ("t2-t4", 2, "2", 4, "4"), ("one-t2", 1, "1", 2, "2")] {
        let checkpoints = dir.join(name);
        let c = checkpoints.to_str().unwrap();
        let mut first = args(d, "3", &["--no-eval", "--tensor-parallel", first_t, "--checkpoint-dir", c]);
        first.extend(["--results", r]);
        mpirun(first_ranks, &first).expect_ok();
        assert_eq!(checkpoint_steps(&checkpoints), vec![3], "{name}");
        let weights = train_saving_weights(&dir, name, then_ranks, &args(d, "6", &["--no-eval", "--tensor-parallel", then_t, "--checkpoint-dir", c, "--resume"]));
        let diff = max_relative_difference(&reference, &weights);
        assert!(diff < 1e-5, "{name}: resumed, differs from the uninterrupted run by {diff:e}");
        // It did resume (3 steps run, from step 3), not train the 6 steps again.
        let runs = read_runs(&dir);
        let last = runs.last().unwrap();
        assert_eq!((last["steps"].as_u64(), last["extra"]["resumed_from_step"].as_u64()), (Some(3), Some(3)), "{name}: {last}");
    }
}

/// A group split over two (fake) nodes is allowed, with a warning naming the cost, and trains to
/// the same weights.
#[test]
fn a_group_across_nodes_warns_and_trains_alike() {
    let dir = scratch("tensor-nodes");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let reference = train_saving_weights(&dir, "one-rank", 1, &args(d, "4", &["--no-eval"]));
    let out = dir.join("across.safetensors");
    let mut a = args(d, "4", &["--no-eval", "--tensor-parallel", "2"]);
    a.extend(["--results", dir.to_str().unwrap(), "--save-weights", out.to_str().unwrap()]);
    let run = mpirun_env(2, &a, &[("HPC_TRAIN_RANKS_PER_NODE", "1")], std::time::Duration::from_secs(120)).expect_ok();
    assert_eq!(run.all_output().matches("a tensor-parallel group spans 2 nodes").count(), 1, "{}", run.all_output());
    let diff = max_relative_difference(&reference, &out);
    assert!(diff < 1e-5, "across nodes: {diff:e}");
}

#[test]
fn tensor_parallel_refuses_what_it_cannot_run() {
    let dir = scratch("tensor-refused");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let checkpoints = dir.join("checkpoints");
    // One size that does not fit the world, and one pair of the compatibility table with a
    // checkpoint folder that must not be made. The other sizes and options refused are unit
    // tests (src/train/plan.rs's layouts_whose_sizes_cannot_run_are_refused); every refused
    // pair of the table is refused in tests/conformance.rs's matrix.
    let cases: Vec<(usize, Vec<&str>, &str)> = vec![
        (3, vec!["--tensor-parallel", "2"], "--tensor-parallel 2 x --pipeline-stages 1 = 2 does not divide the 3 ranks"),
        (2, vec!["--tensor-parallel", "2", "--strategy", "ps", "--checkpoint-dir", checkpoints.to_str().unwrap()], "--strategy ps with --tensor-parallel"),
    ];
    for (ranks, extra, reason) in cases {
        let mut a = args(d, "2", &extra);
        if extra.contains(&"--model") {
            a.drain(0..2);
        }
        a.extend(["--results", dir.to_str().unwrap()]);
        let run = mpirun(ranks, &a);
        assert!(!run.ok(), "{extra:?} accepted");
        assert_eq!(run.all_output().matches(reason).count(), 1, "{extra:?}: {}", run.all_output());
    }
    assert!(!checkpoints.exists(), "a refused run made its checkpoint folder");
}

/// ZeRO 1, 2 and 3 (`--fsdp-hybrid` over two fake nodes too) shard each rank's parts over the
/// replicas that hold the same part: on 4 ranks (D = 2, T = 2) they train to the weights of
/// `--zero 0` (SGD, with LARS, with fp16), evaluate alike, and their checkpoints resume in other
/// layouts (ZeRO 1 x TP by ZeRO 3 x TP, ZeRO 3 x TP by ZeRO 0 x TP, ZeRO 2 x TP by plain ZeRO 2).
/// Within 1e-5: only the order of f32 sums differs (a reduce-scatter against an all-reduce),
/// which stays far below that at this rate and step count on Intel and AMD alike. Small
/// buckets cut ZeRO 1/2's shards through the cut tensors' rows, the units cut stage 3's.
#[test]
fn zero_shards_tensor_parallel_parts_and_trains_to_the_weights_of_zero_0() {
    let dir = scratch("tensor-zero");
    // 48 samples: 3 steps of 16 are an epoch, so each run evaluates at its end.
    let data = synth(&dir, "vit-epoch", 48, 16, "1x16x16", 4);
    let d = data.to_str().unwrap();
    let c = |name: &str| dir.join(name).display().to_string();
    let (c1, c2, c3) = (c("zero1-checkpoints"), c("zero2-checkpoints"), c("zero3-checkpoints"));
    let mut runs = Runs::new(&dir);
    let mut compared: Vec<(&str, PathBuf, PathBuf)> = Vec::new();
    fn t2<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        [&["--tensor-parallel", "2"][..], extra].concat()
    }
    let small_buckets = ["--bucket-mb", "0.01"];
    // LARS at a rate of 1: its steps move each layer by about lr x eta of its norm, and a rate
    // of 0.01 left norms of parts instead of whole layers 2.5e-5 away, too close to 1e-5.
    let small_rate = ["--lr", "0.01"];
    for (optimizer, extra) in [("sgd", &small_rate[..]), ("lars", &["--optimizer", "lars", "--lr", "1"][..]), ("fp16", &["--precision", "fp16", "--lr", "0.01"][..])] {
        let reference = runs.add(&format!("{optimizer}-zero0"), 4, &args(d, "3", &t2(extra)));
        let stages: &[&str] = if optimizer == "fp16" { &["1"] } else { &["1", "2", "3"] };
        for &zero in stages {
            let mut a = t2(extra);
            a.extend(["--zero", zero]);
            if zero != "3" {
                a.extend(small_buckets);
            }
            compared.push((optimizer, reference.clone(), runs.add(&format!("{optimizer}-zero{zero}"), 4, &args(d, "3", &a))));
        }
        if optimizer == "sgd" {
            // Hybrid sharding over fake nodes of one rank: each of a part's replicas on a node
            // of its own, the shards replicated on both.
            let hybrid = runs.add("sgd-zero3-hybrid", 4, &args(d, "3", &t2(&["--lr", "0.01", "--zero", "3", "--fsdp-hybrid"])));
            compared.push(("hybrid", reference.clone(), hybrid));
            // Checkpoints at step 2 of 3, resumed in another layout for the last step.
            for (zero, folder) in [("1", &c1), ("2", &c2), ("3", &c3)] {
                let mut a = args(d, "2", &t2(&["--lr", "0.01", "--zero", zero, "--checkpoint-dir", folder]));
                a.extend(small_buckets);
                runs.add(&format!("zero{zero}-first-two"), 4, &a);
            }
            let resumed = [("zero1, resumed at zero 3", &c1, vec!["--tensor-parallel", "2", "--zero", "3"]), ("zero3, resumed at zero 0", &c3, vec!["--tensor-parallel", "2"]), ("zero2, resumed plain", &c2, vec!["--strategy", "ring", "--zero", "2"])];
            for (name, folder, layout) in resumed {
                let mut a = args(d, "3", &["--lr", "0.01", "--checkpoint-dir", folder, "--resume"]);
                a.extend(layout);
                compared.push((name, reference.clone(), runs.add(&name.replace([',', ' '], "-"), 4, &a)));
            }
        }
    }
    runs.launch_env(&[("HPC_TRAIN_RANKS_PER_NODE", "1")]);
    for (name, reference, weights) in &compared {
        let diff = max_relative_difference(reference, weights);
        assert!(diff < 1e-5, "{name} ({}) differs from --zero 0 by {diff:e}", weights.display());
    }
    let records = read_runs(&dir);
    // The resumed runs did resume, at step 2.
    assert_eq!(records.iter().filter(|r| r["extra"]["resumed_from_step"].as_u64() == Some(2)).count(), 3, "{records:#?}");
    // ZeRO holds half of each part's optimizer state (D = 2); every run evaluated its epoch, a
    // group's samples counted once.
    // (The SGD runs of f32 and 3 steps: the first of each stage is the plain one, not hybrid.)
    let sgd: Vec<&serde_json::Value> = records.iter().filter(|r| r["optimizer"] == "sgd" && r["extra"]["precision"] != "fp16" && r["steps"] == 3 && r["extra"]["resumed_from_step"].is_null()).collect();
    let find = |zero: u64| *sgd.iter().find(|r| r["extra"]["zero"].as_u64() == Some(zero)).unwrap_or_else(|| panic!("zero {zero} in {sgd:#?}"));
    let plain = find(0);
    let state = |r: &serde_json::Value| r["extra"]["optimizer_state_bytes"].as_u64().unwrap() as f64;
    for zero in [1, 2, 3] {
        let ratio = state(find(zero)) / state(plain);
        assert!((ratio - 0.5).abs() < 0.01, "zero {zero}: {ratio} of --zero 0's optimizer state");
    }
    let evaluated: Vec<&&serde_json::Value> = sgd.iter().filter(|r| r["test_loss"].as_f64().is_some()).collect();
    assert_eq!(evaluated.len(), 5, "{sgd:#?}");
    for r in evaluated {
        let (loss, reference) = (r["test_loss"].as_f64().unwrap(), plain["test_loss"].as_f64().unwrap());
        assert!((loss - reference).abs() < 1e-4 * reference.abs(), "test loss {loss} against {reference}: {r}");
        assert_eq!(r["test_accuracy"], plain["test_accuracy"], "{r}");
    }
}
