//! Gradient exchange strategies against MPI_Allreduce, through `hpc-train bench` (every rank
//! checks every element), and in training.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

/// Element counts that catch edge cases: empty, one element, fewer than the ranks, not
/// divisible by the ranks, and large enough for many segments.
const COUNTS: &str = "0,1,3,1001,262147";

fn bench(ranks: usize, strategies: &str, extra: &[&str], results: &Path) -> Run {
    let mut args = vec![
        "bench", "--strategies", strategies, "--iters", "2", "--warmup", "1",
        "--segment-kb", "16", "--results", results.to_str().unwrap(),
    ];
    args.extend(extra);
    mpirun_env(ranks, &args, &[], Duration::from_secs(300))
}

/// Every row of a bench run reports zero wrong elements, and the run succeeded.
/// The rank counts a bench test sweeps: all of `counts` under Open MPI; under MPICH those up to
/// 5. The algorithms' arithmetic at 6 and 7 ranks does not depend on the MPI library, and
/// Open MPI's run has it; MPICH polls without yielding, and 7 ranks on CI's 2 cores made this
/// file take 5 minutes under MPICH against 2 under Open MPI. Under MPICH, 1 to 5 still cover
/// one rank, powers of two and the others (rhd's pre- and post-steps) with MPICH's own
/// MPI_Allreduce as the reference.
fn rank_counts(counts: &[usize]) -> Vec<usize> {
    match common::launcher::mpi() {
        common::launcher::Mpi::Mpich => counts.iter().copied().filter(|&r| r <= 5).collect(),
        common::launcher::Mpi::OpenMpi => counts.to_vec(),
    }
}

fn assert_all_right(run: &Run, rows_expected: usize) {
    assert!(run.ok(), "bench failed:\n{}", run.all_output());
    let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).collect();
    assert_eq!(rows.len(), rows_expected, "{}", run.stdout);
    for row in rows {
        let wrong: u64 = row.split_whitespace().last().unwrap().parse().unwrap();
        assert_eq!(wrong, 0, "{row}");
    }
}

/// ring, rhd and auto against MPI_Allreduce on random input, and with MPI_Allreduce against the
/// closed form of small integers (exact in any summation order), at every rank count: one launch
/// per rank count and check sums the three hand-written algorithms one after another.
#[test]
fn ring_rhd_and_auto_equal_mpi_allreduce_for_every_rank_count_and_size() {
    let dir = scratch("ring-vs-mpi");
    for ranks in rank_counts(&[1, 2, 3, 4, 5, 6, 7]) {
        let run = bench(ranks, "ring,rhd,auto", &["--counts", COUNTS, "--verify", "allreduce"], &dir);
        assert_all_right(&run, 15);
        // The closed form checks the same schedules' arithmetic again: MPICH's run keeps the
        // check against its own MPI_Allreduce above, and Open MPI's checks every algorithm at
        // one rank, a power of two and counts with rhd's pre- and post-steps (six repeats five
        // on 2 cores' time).
        if ranks != 6 && (common::launcher::every_row() || ranks <= 3) {
            let run = bench(ranks, "ring,rhd,auto,allreduce", &["--counts", COUNTS], &dir);
            assert_all_right(&run, 20);
        }
    }
}

/// 16-bit gradients summed in f32 by ring, rhd and auto (and by auto's recursive doubling on
/// every bucket, `model`): against MPI_Allreduce of the same values, and against the closed form.
fn half_precision_sums(dir: &Path, model: &str) {
    for dtype in ["f16", "bf16"] {
        // Under MPICH a power of two and a count with pre- and post-steps.
        for ranks in common::launcher::rows_under_mpich(&[2, 3, 4], |r| r >= 3) {
            let run = bench(ranks, "ring,rhd,auto,allreduce", &["--counts", COUNTS, "--dtype", dtype, "--verify", "allreduce"], dir);
            assert_all_right(&run, 20);
            let run = bench(ranks, "auto", &["--counts", COUNTS, "--dtype", dtype, "--verify", "allreduce", "--cost-model", model], dir);
            assert_all_right(&run, 5);
        }
        // Small integers: every 16-bit sum of them is exact, so the closed form holds.
        if common::launcher::every_row() {
            let run = bench(3, "ring,rhd,auto", &["--counts", COUNTS, "--dtype", dtype], dir);
            assert_all_right(&run, 15);
        }
    }
}

#[test]
fn ring_follows_the_node_layout() {
    // Fake nodes of 2 ranks: the ring order changes, the result does not.
    let dir = scratch("ring-nodes");
    let args = ["bench", "--strategies", "ring", "--counts", COUNTS, "--iters", "1", "--warmup", "0", "--verify", "allreduce", "--results", dir.to_str().unwrap()];
    let run = mpirun_env(5, &args, &[("HPC_TRAIN_RANKS_PER_NODE", "2")], Duration::from_secs(120));
    assert_all_right(&run, 5);
    assert!(run.stdout.contains("on 3 node(s)"), "{}", run.stdout);
    // Ranks on several nodes go over MPI, never through node-shared memory.
    assert!(run.all_output().contains("ring: 5 ranks, MPI point-to-point"), "{}", run.all_output());
}

#[test]
fn the_shared_memory_ring_gives_the_bits_of_the_ring_over_mpi() {
    // On one node the ring reads its neighbours' chunks from node-shared memory; the schedule
    // and the order of every addition are the ring's, so the sums must be equal bit for bit,
    // whatever the rank count, size (pieces of 256 KiB: 262147 floats make several) or type.
    let dir = scratch("ring-shm");
    for ranks in common::launcher::rows_under_mpich(&[2, 3, 5], |r| r == 3) {
        for dtype in ["f32", "bf16"] {
            let mut sums = Vec::new();
            for transport in ["shm", "mpi"] {
                let saved = dir.join(format!("sums-{transport}.bin"));
                let run = bench(ranks, "ring", &["--counts", COUNTS, "--dtype", dtype, "--verify", "allreduce", "--ring-transport", transport, "--save-result", saved.to_str().unwrap()], &dir);
                assert_all_right(&run, 5);
                let way = if transport == "shm" { "node-shared memory" } else { "MPI point-to-point" };
                assert!(run.all_output().contains(&format!("ring: {ranks} ranks, {way}")), "{}", run.all_output());
                sums.push(std::fs::read(&saved).unwrap());
            }
            assert!(!sums[0].is_empty());
            assert!(sums[0] == sums[1], "{ranks} ranks, {dtype}: the shared-memory ring's sums differ from the MPI ring's");
        }
    }
}

#[test]
fn the_shared_memory_ring_is_refused_across_nodes() {
    let dir = scratch("ring-shm-nodes");
    let args = ["bench", "--strategies", "ring", "--counts", "10", "--ring-transport", "shm", "--results", dir.to_str().unwrap()];
    let run = mpirun_env(4, &args, &[("HPC_TRAIN_RANKS_PER_NODE", "2")], Duration::from_secs(60));
    assert!(!run.ok() && !run.timed_out, "{}", run.all_output());
    let message = "--ring-transport shm: the 4 ranks are on 2 node(s)";
    assert_eq!(run.all_output().matches(message).count(), 1, "{}", run.all_output());
}

#[test]
fn a_full_shared_memory_file_system_sends_the_ring_over_mpi_or_stops_it_by_name() {
    // Shared windows are files of the node's shared-memory file system (Open MPI's
    // osc_sm_backing_directory, /dev/shm unless set; MPICH's /dev/shm), which
    // MPI_Win_allocate_shared aborts the job on when it is full: here a 16 MiB tmpfs, as a
    // container's small /dev/shm.
    let dir = scratch("ring-small-shm");
    let shm = dir.join("shm");
    let shm_env = [("OMPI_MCA_osc_sm_backing_directory", shm.to_str().unwrap())];
    let bench = |count: &str, transport: &str| {
        let results = dir.join(format!("{count}-{transport}"));
        let args = ["bench", "--strategies", "ring", "--counts", count, "--iters", "2", "--warmup", "1", "--verify", "allreduce", "--ring-transport", transport, "--results", results.to_str().unwrap()];
        let run = mpirun_with_tmpfs(2, &args, &shm_env, &shm, "16m", Duration::from_secs(120));
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(results.join("bench.jsonl")).unwrap_or_default().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (run, rows)
    };
    let warning = "the ring goes over MPI point-to-point instead";
    // A window of 2 x 4 KiB fits: shared memory, no warning.
    let (run, rows) = bench("1000", "auto");
    assert!(run.ok(), "{}", run.all_output());
    assert_eq!(rows[0]["ring_transport"], "shared-memory", "{}", run.all_output());
    assert!(!run.all_output().contains(warning), "{}", run.all_output());
    // 2 x 16 MiB does not: the same sums over MPI, said once.
    let (run, rows) = bench("4194304", "auto");
    assert!(run.ok(), "{}", run.all_output());
    assert!(run.stdout.lines().filter(|l| !l.starts_with('#')).all(|l| l.ends_with(" 0")), "{}", run.stdout);
    assert_eq!(rows[0]["ring_transport"], "mpi", "{}", run.all_output());
    assert_eq!(run.all_output().matches(warning).count(), 1, "{}", run.all_output());
    // Where the library maps its windows: `shm` for Open MPI, /dev/shm for MPICH.
    let mount = launcher::shared_memory_mount_point(&shm);
    assert!(run.all_output().contains(&format!("needs 32.0 MiB in {}", mount.display())), "{}", run.all_output());
    // Asked for shared memory by name: one clear error, every rank out, nothing hangs.
    let (run, _) = bench("4194304", "shm");
    assert!(!run.ok() && !run.timed_out, "{}", run.all_output());
    assert_eq!(run.all_output().matches("--ring-transport shm: the ring's node-shared window for 2 ranks needs").count(), 1, "{}", run.all_output());
    assert!(!run.all_output().contains("MPI_Win_allocate_shared"), "MPI's own abort, not ours: {}", run.all_output());
}

#[test]
fn the_bench_catches_a_wrong_sum() {
    // A fault injected into one element of one rank's result must show in #wrong and fail the run.
    let dir = scratch("bench-fails");
    for verify in ["closed-form", "allreduce"] {
        let run = bench(2, "ring", &["--counts", "1000", "--verify", verify, "--corrupt-result"], &dir);
        assert!(!run.ok(), "a corrupted result passed:\n{}", run.all_output());
        let row = run.stdout.lines().find(|l| !l.starts_with('#')).expect("a result row");
        assert_eq!(row.split_whitespace().last(), Some("1"), "{row}");
        assert!(run.stderr.contains("wrong element"), "{}", run.stderr);
    }
}

#[test]
fn bench_rows_are_recorded() {
    let dir = scratch("bench-rows");
    let run = bench(2, "ring", &["--counts", "10", "--dtype", "bf16"], &dir);
    assert_all_right(&run, 1);
    let text = std::fs::read_to_string(dir.join("bench.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    for field in ["size", "count", "type", "strategy", "time_us", "algbw", "busbw", "wrong", "ranks", "host", "mpi_library", "date"] {
        assert!(!row[field].is_null(), "bench.jsonl lacks {field}: {row}");
    }
    assert_eq!(row["size"], 20);
    assert_eq!(row["busbw"].as_f64().unwrap(), row["algbw"].as_f64().unwrap(), "2 ranks: bus factor 1");
    assert!(row["memory_bound_busbw"].is_null(), "the bounds are for f32 only: {row}");

    // Host f32 runs carry both bounds, each in the footer and in every row: one core's memory
    // rates, and MPI's own point-to-point rate with every rank sending at once.
    let f32_dir = scratch("bench-rows-f32");
    let run = bench(2, "ring", &["--counts", "1000"], &f32_dir);
    assert_all_right(&run, 1);
    assert!(run.stdout.contains("# Memory bound") && run.stdout.contains("# Transport bound"), "{}", run.stdout);
    let text = std::fs::read_to_string(f32_dir.join("bench.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    for field in ["memory_bound_busbw", "memory_copy_gbs", "memory_add_gbs", "transport_bound_busbw", "transport_gbs"] {
        assert!(row[field].as_f64().is_some_and(|v| v > 0.0), "{field}: {row}");
    }
    assert!(row["transport_bound_busbw"].as_f64() < Some(row["transport_gbs"].as_f64().unwrap()), "the add only lowers the bound: {row}");
}

#[test]
fn bench_rounds_pool_into_one_row_per_strategy_and_size() {
    // Three rounds of two strategies at two sizes: still four rows, each the median of every
    // round's iterations, in the order the strategies were given (not the rotated order).
    let dir = scratch("bench-rounds");
    let run = bench(2, "ring,allreduce", &["--counts", "1000,10", "--rounds", "3"], &dir);
    assert_all_right(&run, 4);
    assert!(run.stdout.contains("3 rounds in rotated order"), "{}", run.stdout);
    let strategies: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split_whitespace().nth(3)).collect();
    assert_eq!(strategies, ["ring", "ring", "allreduce", "allreduce"]);
    let text = std::fs::read_to_string(dir.join("bench.jsonl")).unwrap();
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(row["rounds"], 3, "{row}");
    }
    // A wrong element in every round is counted in every round, and fails the run.
    let run = bench(2, "ring", &["--counts", "1000", "--rounds", "3", "--corrupt-result"], &dir);
    assert!(!run.ok(), "a corrupted result passed:\n{}", run.all_output());
    let wrong: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).filter_map(|l| l.split_whitespace().last()).collect();
    assert_eq!(wrong, ["3"], "{}", run.stdout);
    // Zero rounds is refused by name.
    let run = bench(2, "ring", &["--counts", "10", "--rounds", "0"], &dir);
    assert!(!run.ok() && run.all_output().contains("--rounds"), "{}", run.all_output());
}

/// `allreduce` and `horovod` call the blocking MPI_Allreduce, as users of MPI and Horovod do
/// (issue 32: an in-place MPI_Iallreduce runs Open MPI's libnbc binomial tree, half the
/// bandwidth at large sizes); `--mpi-allreduce nonblocking` keeps the old path. A library
/// preloaded through MPI's profiling interface counts each rank's calls.
#[test]
fn allreduce_and_horovod_call_the_blocking_mpi_allreduce() {
    let dir = scratch("mpi-allreduce-call");
    let shim = dir.join("libcount_mpi_calls.so");
    let source = root().join("tests/fixtures/count_mpi_calls.c");
    let built = std::process::Command::new(common::launcher::compiler()).args(["-shared", "-fPIC", "-O2", "-o"]).arg(&shim).arg(&source).status().expect("mpicc runs");
    assert!(built.success(), "mpicc could not build {}", source.display());
    let prefix = dir.join("counts");
    let counts = |ranks: usize| -> Vec<(u64, u64)> {
        (0..ranks)
            .map(|r| {
                let text = std::fs::read_to_string(format!("{}.{r}", prefix.display())).expect("the shim wrote its counts");
                let v: Vec<u64> = text.split_whitespace().map(|x| x.parse().unwrap()).collect();
                (v[0], v[1])
            })
            .collect()
    };
    let env = [("LD_PRELOAD", shim.to_str().unwrap()), ("COUNT_MPI_CALLS", prefix.to_str().unwrap())];
    for (strategy, call, iallreduce_expected) in [("allreduce", "blocking", false), ("horovod", "blocking", false), ("allreduce", "nonblocking", true)] {
        let args = [
            "bench", "--strategies", strategy, "--counts", "1001,262147", "--iters", "3", "--warmup", "1", "--verify", "allreduce",
            "--mpi-allreduce", call, "--results", dir.to_str().unwrap(),
        ];
        let run = mpirun_env(2, &args, &env, Duration::from_secs(120));
        assert_all_right(&run, 2);
        for (rank, (allreduce, iallreduce)) in counts(2).into_iter().enumerate() {
            // Every timed and warm-up iteration at both sizes: 8 exchanges at least.
            if iallreduce_expected {
                assert!(iallreduce >= 8, "{strategy} --mpi-allreduce {call}, rank {rank}: {iallreduce} MPI_Iallreduce calls");
            } else {
                assert_eq!(iallreduce, 0, "{strategy} --mpi-allreduce {call}, rank {rank}: MPI_Iallreduce was called");
                assert!(allreduce >= 8, "{strategy}, rank {rank}: {allreduce} MPI_Allreduce calls");
            }
        }
    }
    // The record says which call ran.
    let data = synth(&dir, "call", 40, 0, "1x8x8", 3);
    for call in ["blocking", "nonblocking"] {
        let args = [
            "--model", "tiny", "--data", data.to_str().unwrap(), "--steps", "2", "--batch-size", "4", "--no-eval", "--threads", "1",
            "--strategy", "allreduce", "--mpi-allreduce", call, "--results", dir.to_str().unwrap(),
        ];
        mpirun(2, &args).expect_ok();
        assert_eq!(read_runs(&dir).last().unwrap()["extra"]["mpi_allreduce"], call);
    }
}

#[test]
fn ring_trains_to_the_same_weights_as_allreduce() {
    let dir = scratch("ring-train");
    let data = synth(&dir, "rt", 90, 0, "1x12x12", 5);
    // Every run in one launch (common::Runs); the records come in the order the runs were added.
    let mut runs = Runs::new(&dir);
    let mut outs = Vec::new();
    for ranks in [2, 3, 4] {
        // The ring through node-shared memory (the default on one node), then over MPI.
        for (strategy, transport) in [("allreduce", "auto"), ("ring", "auto"), ("ring", "mpi")] {
            let out = runs.add(&format!("{strategy}{ranks}{transport}"), ranks, &[
                "--strategy", strategy, "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong",
                "--global-batch", "12", "--steps", "8", "--no-eval", "--threads", "1", "--segment-kb", "1",
                "--ring-transport", transport,
            ]);
            outs.push((ranks, strategy, transport, out));
        }
    }
    runs.launch();
    let records = read_runs(&dir);
    let ring_transports: Vec<(usize, &str)> = records.iter().filter(|r| r["strategy"] == "ring").map(|r| (r["ranks"].as_u64().unwrap() as usize, r["extra"]["ring_transport"].as_str().unwrap())).collect();
    let expected: Vec<(usize, &str)> = outs.iter().filter(|o| o.1 == "ring").map(|&(ranks, _, transport, _)| (ranks, if transport == "mpi" { "mpi" } else { "shared-memory" })).collect();
    let mut sorted = ring_transports.clone();
    sorted.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(sorted, expected_sorted, "{records:#?}");
    for group in outs.chunks(3) {
        let ranks = group[0].0;
        let diff = max_relative_difference(&group[0].3, &group[1].3);
        assert!(diff < 1e-5, "{ranks} ranks: ring differs from allreduce by {diff:e}");
        let diff = max_relative_difference(&group[1].3, &group[2].3);
        assert_eq!(diff, 0.0, "{ranks} ranks: the ring through shared memory differs from the ring over MPI");
    }
}

#[test]
fn staged_gpu_path_when_a_gpu_is_present() {
    if !Path::new("/dev/nvidia0").exists() {
        eprintln!("skipped: no GPU on this machine (the staged and direct GPU paths need one)");
        return;
    }
    let dir = scratch("ring-gpu");
    for aware in ["no", "auto"] {
        let run = bench(2, "ring,allreduce", &["--counts", COUNTS, "--device", "cuda", "--cuda-aware", aware, "--verify", "allreduce"], &dir);
        assert_all_right(&run, 10);
    }
}

/// The staged path (what a GPU run takes without a CUDA-aware MPI: copies into alternating
/// host buffers, the reduction there, copies back) run on CPU tensors through
/// HPC_TRAIN_STAGE_HOST, for every strategy and element type, including the 16-bit sums that
/// MPI runs as a host function and Horovod's compressed fusion buffers.
#[test]
fn the_staged_path_gives_the_right_sums() {
    if covered_by_the_first_mpi("the staged path's arithmetic (host copies around the same MPI calls)") {
        return;
    }
    let dir = scratch("staged");
    let staged = [("HPC_TRAIN_STAGE_HOST", "1")];
    let run_bench = |ranks: usize, strategies: &str, extra: &[&str]| {
        let mut args = vec!["bench", "--strategies", strategies, "--iters", "2", "--warmup", "1", "--segment-kb", "16", "--results", dir.to_str().unwrap()];
        args.extend(extra);
        mpirun_env(ranks, &args, &staged, Duration::from_secs(300))
    };
    for ranks in [2, 3] {
        let run = run_bench(ranks, "ring,allreduce,horovod,ps", &["--counts", COUNTS, "--verify", "allreduce"]);
        assert_all_right(&run, 20);
        assert!(run.stderr.is_empty() || !run.stderr.contains("error"), "{}", run.stderr);
        for dtype in ["f16", "bf16"] {
            let run = run_bench(ranks, "ring,allreduce,horovod", &["--counts", COUNTS, "--dtype", dtype, "--verify", "allreduce"]);
            assert_all_right(&run, 15);
        }
        // Horovod's fp16 and bf16 compression of f32 buffers, reduced as 16-bit words.
        for compression in ["fp16", "bf16"] {
            let run = run_bench(ranks, "horovod", &["--counts", COUNTS, "--compression", compression, "--layout", "resnet50"]);
            assert_all_right(&run, 5);
        }
    }
}

/// Training through the staged path, with overlap (the default), ends with the weights of the
/// host path: every strategy, ZeRO's bucket through its host mirror (stages 1 and 2, overlap on
/// and off), ZeRO 3's units through its one reused host buffer, and the colocated parameter
/// server's packing through its device buffers.
#[test]
fn training_through_the_staged_path_matches_the_host_path() {
    if covered_by_the_first_mpi("the staged path's arithmetic (host copies around the same MPI calls)") {
        return;
    }
    let dir = scratch("staged-train");
    let data = synth(&dir, "st", 90, 0, "1x12x12", 5);
    let mut runs = Runs::new(&dir);
    let add = |runs: &mut Runs, name: &str, extra: &[&str]| {
        let mut args = vec![
            "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong",
            "--global-batch", "12", "--steps", "8", "--no-eval", "--threads", "1", "--bucket-mb", "0.001",
        ];
        args.extend(extra);
        runs.add(name, 3, &args)
    };
    let reference = add(&mut runs, "host", &["--strategy", "allreduce"]);
    runs.launch();
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("allreduce", vec!["--strategy", "allreduce"]),
        ("ring", vec!["--strategy", "ring"]),
        ("horovod", vec!["--strategy", "horovod"]),
        ("ps", vec!["--strategy", "ps"]),
        ("ps-colocated", vec!["--strategy", "ps", "--ps-colocate"]),
        ("ring-zero1-overlap", vec!["--strategy", "ring", "--zero", "1", "--overlap", "on"]),
        ("ring-zero2", vec!["--strategy", "ring", "--zero", "2", "--overlap", "off"]),
        ("ring-zero3", vec!["--strategy", "ring", "--zero", "3"]),
    ];
    // The staged runs in one launch under the test hook (the reference above ran without it).
    let staged: Vec<PathBuf> = cases.iter().map(|(name, extra)| add(&mut runs, &format!("staged-{name}"), extra)).collect();
    runs.launch_env(&[("HPC_TRAIN_STAGE_HOST", "1")]);
    for ((name, _), staged) in cases.iter().zip(&staged) {
        let diff = max_relative_difference(&reference, staged);
        assert!(diff < 1e-5, "{name} through the staged path differs by {diff:e}");
    }
    let runs = read_runs(&dir);
    assert_eq!(runs.iter().filter(|r| r["data_path"] == "staged").count(), cases.len(), "{runs:#?}");
    for zero in runs.iter().filter(|r| r["extra"]["zero"].as_u64().unwrap_or(0) > 0) {
        assert!(zero["extra"]["staging_copy_ms"].as_f64().is_some(), "ZeRO on the staged path reports its copies: {zero}");
    }
    // ZeRO 3's gathers and reduce-scatters of every unit and step pass through one reused host
    // buffer (pinned on a GPU), not a fresh one each.
    let zero3: Vec<_> = runs.iter().filter(|r| r["extra"]["zero"].as_u64() == Some(3)).collect();
    assert_eq!(zero3.len(), 1, "{runs:#?}");
    assert_eq!(zero3[0]["extra"]["staging_host_buffers"].as_u64(), Some(1), "{}", zero3[0]);
    assert!(zero3[0]["extra"]["fsdp_units"].as_u64().unwrap_or(0) > 1, "several units share the buffer: {}", zero3[0]);
}

/// One rank's mean is its own gradients: ring, rhd and auto train on one rank through the
/// staged path to the weights of MPI_Allreduce's run, without packing or staging a byte (no
/// copy waited for, no bucket sent to any algorithm).
#[test]
fn one_rank_exchanges_nothing() {
    // One rank makes no MPI call to exchange: nothing here depends on the MPI library (Open
    // MPI's run, common::launcher::every_row).
    if !common::launcher::every_row() {
        return;
    }
    let dir = scratch("one-rank");
    let data = synth(&dir, "one", 48, 0, "1x12x12", 5);
    let train = |strategy: &str| {
        let out = dir.join(format!("{strategy}.safetensors"));
        let args = [
            "--model", "tiny", "--data", data.to_str().unwrap(), "--batch-size", "8", "--steps", "5", "--no-eval", "--threads", "1",
            "--bucket-mb", "0.001", "--strategy", strategy, "--results", dir.to_str().unwrap(), "--save-weights", out.to_str().unwrap(),
        ];
        mpirun_env(1, &args, &[("HPC_TRAIN_STAGE_HOST", "1")], Duration::from_secs(120)).expect_ok();
        out
    };
    let reference = train("allreduce");
    for strategy in ["ring", "rhd", "auto"] {
        let diff = max_relative_difference(&reference, &train(strategy));
        assert!(diff < 1e-6, "{strategy} on one rank differs from MPI_Allreduce's run by {diff:e}");
    }
    let runs = read_runs(&dir);
    assert_eq!(runs.len(), 4, "{runs:#?}");
    for run in runs.iter().filter(|r| r["strategy"] != "allreduce") {
        assert_eq!(run["data_path"], "staged", "{run}");
        assert_eq!(run["extra"]["staging_copy_ms"].as_f64(), Some(0.0), "one rank copies nothing to the host: {run}");
    }
    let auto = runs.iter().find(|r| r["strategy"] == "auto").expect("auto's run");
    for algorithm in ["ring", "rhd", "doubling"] {
        assert_eq!(auto["extra"][format!("auto_{algorithm}_buckets")], 0, "one rank sends no bucket to {algorithm}: {auto}");
    }
}

/// Recursive halving-doubling and the per-bucket choice equal MPI_Allreduce for every rank
/// count (powers of two and the others, with their pre- and post-steps), every element count
/// and every element type.
/// rhd's short-message algorithm on every path, and every algorithm on 16-bit values.
#[test]
fn recursive_doubling_and_half_precision_equal_mpi_allreduce() {
    let dir = scratch("rhd-vs-mpi");
    // A model where only the message count matters sends every bucket, large ones too, to
    // recursive doubling (the fewest messages): the short-message algorithm on every path.
    let doubling = dir.join("messages-only-model.json");
    let link = serde_json::json!({ "alpha_s": 1.0, "beta_s_per_byte": 0.0 });
    std::fs::write(&doubling, serde_json::json!({ "intra": link, "inter": link, "gamma_s_per_byte": 0.0 }).to_string()).unwrap();
    let model = doubling.to_str().unwrap();
    // Against MPI_Allreduce only: the sums of known values are checked for auto at every rank
    // count, and recursive doubling's pre- and post-steps are the same for either check.
    for ranks in common::launcher::rows_under_mpich(&rank_counts(&[1, 2, 3, 5, 7]), |r| r == 3) {
        let run = bench(ranks, "auto", &["--counts", COUNTS, "--verify", "allreduce", "--cost-model", model], &dir);
        assert_all_right(&run, 5);
    }
    half_precision_sums(&dir, model);
}

/// rhd and auto train to allreduce's weights, with overlap on and off, and auto records which
/// algorithm its buckets went to.
#[test]
fn rhd_and_auto_train_to_the_same_weights_as_allreduce() {
    let dir = scratch("rhd-train");
    let data = synth(&dir, "rhd", 90, 0, "1x12x12", 5);
    let train = |name: &str, ranks: usize, extra: &[&str]| {
        let out = dir.join(format!("{name}.safetensors"));
        let mut args = vec![
            "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12", "--steps", "8",
            "--no-eval", "--threads", "1", "--bucket-mb", "0.001", "--results", dir.to_str().unwrap(), "--save-weights", out.to_str().unwrap(),
        ];
        args.extend(extra);
        mpirun(ranks, &args).expect_ok();
        out
    };
    // MPICH's run trains at 3 ranks (rhd's pre- and post-steps), and leaves the power of two and
    // auto's cost-model choices, arithmetic that no MPI call changes, to Open MPI's.
    // These runs in one launch (common::Runs), then their comparisons.
    let (mut runs, mut compared) = (Runs::new(&dir), Vec::new());
    let common_args: Vec<String> = [
        "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12", "--steps", "8", "--no-eval", "--threads", "1",
        "--bucket-mb", "0.001",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args = |extra: &[&str]| -> Vec<String> { common_args.iter().cloned().chain(extra.iter().map(|s| s.to_string())).collect() };
    for ranks in common::launcher::rows_under_mpich(&[3, 4], |r| r == 3) {
        let a = args(&["--strategy", "allreduce", "--overlap", "off"]);
        let reference = runs.add(&format!("allreduce{ranks}"), ranks, &a.iter().map(String::as_str).collect::<Vec<_>>());
        for strategy in ["rhd", "auto"] {
            for overlap in ["on", "off"] {
                let a = args(&["--strategy", strategy, "--overlap", overlap]);
                let got = runs.add(&format!("{strategy}{ranks}{overlap}"), ranks, &a.iter().map(String::as_str).collect::<Vec<_>>());
                compared.push((format!("{strategy} at {ranks} ranks, overlap {overlap}"), reference.clone(), got));
            }
        }
    }
    runs.launch();
    for (what, reference, got) in compared {
        let diff = max_relative_difference(&reference, &got);
        assert!(diff < 1e-5, "{what} differs by {diff:e}");
    }
    let runs = read_runs(&dir);
    let auto = runs.iter().find(|r| r["strategy"] == "auto").unwrap();
    let buckets: u64 = ["ring", "rhd", "doubling"].iter().map(|a| auto["extra"][format!("auto_{a}_buckets")].as_u64().unwrap()).sum();
    assert!(buckets > 0, "{auto}");
    // The tiny CNN's 1 KB buckets are latency-bound: the default model sends them to recursive
    // doubling.
    assert!(auto["extra"]["auto_doubling_buckets"].as_u64().unwrap() > 0, "{auto}");

    if !common::launcher::every_row() {
        return;
    }
    // A model whose shared-memory ring is free and whose MPI messages are dear: on one node auto
    // sends every bucket to the ring, which then runs through shared memory; told to keep the
    // ring on MPI, it costs it as MPI messages and sends it nothing.
    let model = dir.join("cheap-shared-memory.json");
    let dear = serde_json::json!({ "alpha_s": 1e-3, "beta_s_per_byte": 1e-9 });
    let free = serde_json::json!({ "alpha_s": 0.0, "beta_s_per_byte": 0.0 });
    std::fs::write(&model, serde_json::json!({ "intra": dear, "inter": dear, "shared": free, "gamma_s_per_byte": 1e-10 }).to_string()).unwrap();
    let reference = train("allreduce3-overlap", 3, &["--strategy", "allreduce"]);
    for transport in ["auto", "mpi"] {
        let got = train(&format!("auto-shm-{transport}"), 3, &["--strategy", "auto", "--cost-model", model.to_str().unwrap(), "--ring-transport", transport]);
        assert!(max_relative_difference(&reference, &got) < 1e-5);
        let auto = read_runs(&dir).into_iter().rev().find(|r| r["strategy"] == "auto").unwrap();
        let ring = auto["extra"]["auto_ring_buckets"].as_u64().unwrap();
        if transport == "auto" {
            assert!(ring > 0 && auto["extra"]["auto_rhd_buckets"] == 0 && auto["extra"]["auto_doubling_buckets"] == 0, "{auto}");
            assert_eq!(auto["extra"]["ring_transport"], "shared-memory", "{auto}");
        } else {
            assert_eq!(ring, 0, "{auto}");
            assert_eq!(auto["extra"]["ring_transport"], "mpi", "{auto}");
        }
    }
}
