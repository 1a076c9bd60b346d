//! `hpc-train model fit` and `hpc-train project`: the fit recovers known link costs from bench
//! rows made with them, and a projection writes its tables, report and validation.

mod common;

use common::*;

/// Bench rows as `hpc-train bench` writes them, timed by the closed forms with known costs:
/// within a node alpha 4 us, 2 GB/s; between nodes 50 us, 0.1 GB/s; adds at 3 GB/s. With
/// `nics_per_node`, rhd's ranks crossing the network at once share that many links per node.
fn synthetic_rows(nics_per_node: Option<usize>) -> String {
    let (ai, bi, ae, be, g) = (4e-6, 1.0 / 2e9, 50e-6, 1.0 / 0.1e9, 1.0 / 3e9);
    let mut out = String::new();
    for (ranks, nodes) in [(2usize, 1usize), (4, 1), (2, 2), (4, 2)] {
        for size in [4096usize, 65536, 1 << 20, 16 << 20] {
            let s = size as f64;
            let n = ranks as f64;
            let (a, b) = if nodes > 1 { (ae, be) } else { (ai, bi) };
            let ring = 2.0 * (n - 1.0) * (a + s / n * b) + (n - 1.0) * s / n * g;
            // Power-of-two rhd: log2(n) steps each way; partners across nodes in the first step
            // when the ranks span two nodes (node-major numbering).
            let mut rhd = 0.0;
            let mut part = s / 2.0;
            let mut mask = ranks / 2;
            while mask > 0 {
                let crosses = nodes > 1 && mask >= ranks / nodes;
                let (a, b) = if crosses { (ae, be) } else { (ai, bi) };
                let share = match nics_per_node {
                    Some(k) if crosses => (ranks / nodes).div_ceil(k) as f64,
                    _ => 1.0,
                };
                rhd += 2.0 * (a + part * b * share) + part * g;
                part /= 2.0;
                mask /= 2;
            }
            for (strategy, t) in [("ring", ring), ("rhd", rhd)] {
                out.push_str(&format!(
                    "{{\"size\":{size},\"count\":{},\"type\":\"float\",\"strategy\":\"{strategy}\",\"tensors\":1,\"layout\":\"single\",\"time_us\":{},\"algbw\":0,\"busbw\":0,\"wrong\":0,\"ranks\":{ranks},\"nodes\":{nodes},\"device\":\"cpu\",\"iters\":5,\"host\":\"h\",\"mpi_library\":\"m\",\"git_commit\":\"c\",\"date\":\"d\",\"memory_add_gbs\":3.0,\"link_mbit\":800}}\n",
                    size / 4,
                    t * 1e6
                ));
            }
        }
    }
    out
}

#[test]
fn the_fit_recovers_known_link_costs_and_the_projection_validates_against_them() {
    let dir = scratch("projection");
    let bench = dir.join("bench.jsonl");
    std::fs::write(&bench, synthetic_rows(None)).unwrap();
    let model = dir.join("model.json");
    let run = hpc_train(&["model", "fit", "--bench", bench.to_str().unwrap(), "--out", model.to_str().unwrap()]).expect_ok();
    assert!(run.stdout.contains("median |error| 0.0%"), "{}", run.stdout);
    let fitted: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&model).unwrap()).unwrap();
    let close = |got: f64, want: f64| (got - want).abs() / want < 1e-3;
    let m = &fitted["model"];
    assert!(close(m["intra"]["alpha_s"].as_f64().unwrap(), 4e-6), "{m}");
    assert!(close(m["intra"]["beta_s_per_byte"].as_f64().unwrap(), 0.5e-9), "{m}");
    assert!(close(m["inter"]["alpha_s"].as_f64().unwrap(), 50e-6), "{m}");
    assert!(close(m["inter"]["beta_s_per_byte"].as_f64().unwrap(), 1e-8), "{m}");

    // A profile that points at the fitted model, projected to 1,024 ranks and validated.
    let profile = dir.join("local.toml");
    std::fs::write(&profile, format!("name = \"test\"\nranks_per_node = 2\nfitted = \"{}\"\n", model.display())).unwrap();
    let out = dir.join("projection");
    let run = hpc_train(&[
        "project", "--profile", profile.to_str().unwrap(), "--model", "resnet18", "--compute-ms", "100", "--batch", "32",
        "--ranks", "1,2,4,1024", "--out", out.to_str().unwrap(), "--validate-bench", bench.to_str().unwrap(),
    ])
    .expect_ok();
    assert!(run.stdout.contains("| ring (projected) | 1024 | 512 |"), "{}", run.stdout);
    let csv = std::fs::read_to_string(out.join("validation.csv")).unwrap();
    assert!(csv.starts_with("strategy,ranks,nodes,link_mbit,size_bytes,measured_us,predicted_us,error_pct\n"), "{csv}");
    assert_eq!(csv.lines().count(), 1 + 32, "{csv}");
    assert!(csv.lines().skip(1).all(|l| l.ends_with(",0.0") || l.ends_with(",-0.0")), "{csv}");
    assert!(out.join("local-resnet18").join("report.md").exists() || std::fs::read_dir(&out).unwrap().count() >= 3);
    // A profile without the figures it needs is a clear error.
    std::fs::write(&profile, "name = \"bad\"\nranks_per_node = 8\n").unwrap();
    let run = hpc_train(&["project", "--profile", profile.to_str().unwrap(), "--compute-ms", "1", "--out", out.to_str().unwrap()]);
    assert!(!run.ok() && run.all_output().contains("profile bad: no [intra] link"), "{}", run.all_output());
}

#[test]
fn the_fit_knows_ranks_that_share_a_nodes_link() {
    // Rows made with one link per node (rhd's 2 ranks per node crossing at once at half rate):
    // fitted with --nics-per-node 1 the costs come back exactly, and the model file says so;
    // fitted as if every rank had its own link, they do not.
    let dir = scratch("projection-nics");
    let bench = dir.join("bench.jsonl");
    std::fs::write(&bench, synthetic_rows(Some(1))).unwrap();
    let model = dir.join("model.json");
    let fit = |extra: &[&str]| {
        let mut args = vec!["model", "fit", "--bench", bench.to_str().unwrap(), "--out", model.to_str().unwrap()];
        args.extend(extra);
        hpc_train(&args).expect_ok()
    };
    let run = fit(&["--nics-per-node", "1"]);
    assert!(run.stdout.contains("median |error| 0.0%") && run.stdout.contains("1 network link(s) per node"), "{}", run.stdout);
    let fitted: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&model).unwrap()).unwrap();
    assert_eq!(fitted["model"]["nics_per_node"], 1, "{fitted}");
    let beta = fitted["model"]["inter"]["beta_s_per_byte"].as_f64().unwrap();
    assert!((beta - 1e-8).abs() / 1e-8 < 1e-3, "{beta}");
    let run = fit(&[]);
    assert!(!run.stdout.contains("median |error| 0.0%"), "{}", run.stdout);
    let run = hpc_train(&["model", "fit", "--bench", bench.to_str().unwrap(), "--out", model.to_str().unwrap(), "--nics-per-node", "0"]);
    assert!(!run.ok() && run.all_output().contains("--nics-per-node"), "{}", run.all_output());
}

/// `project --plan` (issue 38): GPT-3 175B on 1,024 GPUs of the DGX A100 profile. Every layout
/// listed fits the memory given and multiplies out to the GPUs and the batch; the fastest is
/// marked and first; GPT-3 needs model parallelism (no layout without it fits 80 GB); halving the
/// memory leaves fewer layouts; bad input is refused by name.
#[test]
fn the_plan_lists_the_layouts_that_fit_fastest_first() {
    let out = scratch("plan");
    let profile = root().join("jobs/clusters/dgx-a100-hdr.toml");
    let plan = |extra: &[&str]| {
        let mut a = vec!["project", "--plan", "--profile", profile.to_str().unwrap(), "--transformer", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536", "--out", out.to_str().unwrap()];
        a.extend(extra);
        hpc_train(&a)
    };
    let run = plan(&[]).expect_ok();
    assert!(run.stdout.contains("(fastest)") && run.stdout.contains("| D | P | T |"), "{}", run.stdout);
    let rows = |path: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(out.join(path)).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let all = rows("dgx-a100-hdr-gpt3-1024gpus-plan.jsonl");
    assert!(all.len() > 10, "{}", all.len());
    let mut last = 0.0;
    for r in &all {
        let l = &r["layout"];
        let get = |k: &str| l[k].as_u64().unwrap();
        assert_eq!(get("data") * get("pipeline") * get("tensor"), 1024, "{r}");
        assert_eq!(get("data") * get("micro_batch") * get("micro_batches"), 1536, "{r}");
        assert_eq!(96 % get("tensor"), 0, "{r}");
        assert_eq!(96 % get("pipeline"), 0, "{r}");
        assert!(get("tensor") * get("pipeline") > 1, "GPT-3 fits no GPU whole: {r}");
        let memory = l["state_bytes"].as_f64().unwrap() + l["activation_bytes"].as_f64().unwrap();
        assert!(memory <= 80e9, "{r}");
        let step = l["step_s"].as_f64().unwrap();
        assert!(step >= last, "fastest first: {r}");
        last = step;
    }
    plan(&["--gpu-memory-gb", "40"]).expect_ok();
    let tighter = rows("dgx-a100-hdr-gpt3-1024gpus-plan.jsonl");
    assert!(tighter.len() < all.len(), "{} against {}", tighter.len(), all.len());

    let run = plan(&["--gpu-memory-gb", "1"]).expect_ok();
    assert!(run.stdout.contains("No layout fits"), "{}", run.stdout);
    for (extra, message) in [
        (vec!["--gpu-tflops", "0"], "--gpu-tflops 0: expected a positive number"),
        (vec!["--heads", "7"], "--hidden 12288: not a multiple of the 7 heads (--heads)"),
        (vec!["--tokens", "0"], "--tokens 0: expected at least 1"),
    ] {
        let run = plan(&extra);
        assert!(!run.ok() && run.all_output().contains(message), "{extra:?}: {}", run.all_output());
    }
}
