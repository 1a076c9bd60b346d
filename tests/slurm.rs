//! The job files in jobs/, submitted for real to a single-node Slurm on loopback (started and
//! stopped by scripts/local-slurm.sh), in small configurations.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// A local Slurm for the length of a test; stopped (by PID) when dropped, even on failure.
struct LocalSlurm {
    dir: PathBuf,
    conf: PathBuf,
}

impl LocalSlurm {
    fn start(dir: &Path) -> Option<LocalSlurm> {
        let available = ["slurmctld", "slurmd", "munged", "sbatch"]
            .iter()
            .all(|tool| Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().is_ok_and(|o| o.status.success()));
        if !available {
            eprintln!("skipped: Slurm (slurm-wlm, munge) is not installed here and scripts/test.sh could not install it");
            return None;
        }
        let out = Command::new(root().join("scripts/local-slurm.sh")).arg("start").arg(dir).output().unwrap();
        assert!(out.status.success(), "starting Slurm: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Some(LocalSlurm { dir: dir.to_path_buf(), conf: dir.join("slurm.conf") })
    }

    /// A job file submitted with the given environment and options, waited for
    /// ([`sbatch_and_wait`]); returns the log.
    fn submit(&self, job: &str, env: &[(&str, &str)], options: &[&str], log: &Path) -> String {
        let (run, text) = self.submit_any(job, env, options, log);
        assert!(run.ok(), "{job} failed ({:?}):\n{}{}\n--- job log ---\n{text}", run.status, run.stdout, run.stderr);
        text
    }

    /// [`LocalSlurm::submit`] for a job that may fail: how sbatch ended, and the job's log.
    fn submit_any(&self, job: &str, env: &[(&str, &str)], options: &[&str], log: &Path) -> (Run, String) {
        let run = sbatch_and_wait(
            |cmd| {
                cmd.args(options)
                    .arg(format!("--output={}", log.display()))
                    .arg(root().join(job))
                    .current_dir(root())
                    .env("SLURM_CONF", &self.conf)
                    // The binary under test (built against Open MPI or MPICH), not the default path.
                    .env("HPC_TRAIN", bin())
                    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
                    .envs(env.iter().copied());
            },
            Duration::from_secs(600),
        );
        (run, std::fs::read_to_string(log).unwrap_or_default())
    }
}

impl Drop for LocalSlurm {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/local-slurm.sh")).arg("stop").arg(&self.dir).status();
    }
}

impl LocalSlurm {
    /// The `srun --mpi` plugin for the binary under test: `pmix` for Open MPI where this Slurm
    /// has it (Debian 12's slurm-wlm 22.05 has), else `pmi2`, which the MPICH family speaks.
    fn mpi_plugin(&self) -> &'static str {
        if launcher::mpi() == launcher::Mpi::Mpich {
            return "pmi2";
        }
        let list = Command::new("srun").arg("--mpi=list").env("SLURM_CONF", &self.conf).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&list.stdout), String::from_utf8_lossy(&list.stderr));
        if text.lines().any(|l| l.trim() == "pmix") { "pmix" } else { "pmi2" }
    }

    /// `srun -n <tasks> hpc-train <args>` on the node, with the MPI plugin `plugin`.
    fn srun(&self, plugin: &str, tasks: usize, args: &[&str]) -> Run {
        let mut cmd = Command::new("srun");
        cmd.arg(format!("--mpi={plugin}"))
            .args(["--ntasks", &tasks.to_string(), "--overcommit", "--kill-on-bad-exit=1"])
            .arg(bin())
            .args(args)
            .current_dir(root())
            .env("SLURM_CONF", &self.conf);
        run_with_limit(cmd, Duration::from_secs(120))
    }
}

/// A command that is rank 0's work alone (`compat`, `report`, `data info`) under `srun -n 2`:
/// done once. Under `--mpi=pmix` no Open MPI or PMI variable says that several tasks were
/// launched, only Slurm's and PMIx's, and each task did the whole work: the table twice, a
/// report written by two processes at once. A bad input is one error line, and the step fails.
#[test]
fn a_serial_command_under_srun_runs_once() {
    let dir = scratch("slurm-serial");
    let Some(slurm) = LocalSlurm::start(&dir.join("cluster")) else { return };
    let plugin = slurm.mpi_plugin();
    eprintln!("launching with srun --mpi={plugin}");
    let alone = hpc_train(&["compat", "--tsv"]).expect_ok();
    let under_srun = slurm.srun(plugin, 2, &["compat", "--tsv"]).expect_ok();
    assert!(under_srun.stdout == alone.stdout, "srun --mpi={plugin}: {} lines printed, {} alone\n{}", under_srun.stdout.lines().count(), alone.stdout.lines().count(), under_srun.stderr);
    let missing = dir.join("missing.h5");
    let bad = slurm.srun(plugin, 2, &["data", "info", missing.to_str().unwrap()]);
    let errors: Vec<&str> = bad.stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert!(!bad.ok() && errors.len() == 1 && errors[0].contains("missing.h5"), "srun --mpi={plugin}: {:?}\n{}{}", bad.status, bad.stdout, bad.stderr);
}

/// The fence the job files give `srun --mpi=pmix` steps (results/cluster-path/pmix-fence.md),
/// read from their log outside Slurm: `jobs/bench.sbatch` with one rank launches nothing. The
/// ring by default, a `SLURM_PMIX_FENCE` the site set kept, `PMIX_FENCE=site` leaving it unset,
/// and an unknown value refused by name before anything starts.
#[test]
fn the_job_files_fence_pmix_steps_with_the_ring_unless_the_site_chose() {
    let dir = scratch("slurm-pmix-fence");
    let job = |env: &[(&str, &str)]| {
        let out = Command::new("bash")
            .arg(root().join("jobs/bench.sbatch"))
            .current_dir(root())
            .env("HPC_TRAIN", bin())
            .env("SRUN_MPI", "pmix")
            .env("RANK_COUNTS", "1")
            .env("OUTPUT_DIR", &dir)
            .env("JOB_LOG", "")
            .env_remove("SLURM_PMIX_FENCE")
            .env_remove("PMIX_FENCE")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (out.status.code(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    };
    let fence_line = |text: &str| text.lines().find(|l| l.starts_with("srun --mpi=pmix: the PMIx fence is ")).map(str::to_string);
    for (env, expected) in [
        (vec![], "SLURM_PMIX_FENCE=ring"),
        (vec![("SLURM_PMIX_FENCE", "tree")], "SLURM_PMIX_FENCE=tree"),
        (vec![("PMIX_FENCE", "mixed")], "SLURM_PMIX_FENCE=mixed"),
        (vec![("PMIX_FENCE", "site")], "SLURM_PMIX_FENCE=(unset: mpi.conf PMIxCollFence, else mixed)"),
    ] {
        let (code, text) = job(&env);
        assert_eq!(code, Some(0), "{env:?}:\n{text}");
        assert_eq!(fence_line(&text), Some(format!("srun --mpi=pmix: the PMIx fence is {expected}")), "{env:?}:\n{text}");
    }
    let (code, text) = job(&[("PMIX_FENCE", "star")]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("PMIX_FENCE=star: expected ring, tree, mixed or site") && fence_line(&text).is_none(), "{text}");
}

/// Options for the single node: no GPUs, more ranks than cores allowed.
const NODE: [&str; 5] = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--overcommit"];

#[test]
fn job_files_run_under_slurm_and_write_their_results() {
    let dir = scratch("slurm");
    let Some(slurm) = LocalSlurm::start(&dir.join("cluster")) else { return };
    let data = synth(&dir, "slurm", 400, 40, "1x16x16", 4);
    let results = dir.join("results");
    let (d, r) = (data.to_str().unwrap(), results.to_str().unwrap());
    let common = [
        ("RESULTS", r), ("DATA", d), ("MODEL", "tiny"), ("STEPS", "8"), ("GPUS_PER_RANK", "0"),
        ("RANK_COUNTS", "1 2"), ("EXTRA_ARGS", "--no-eval --threads 1"), ("PRESET", ""), ("JOB_LOG", ""),
    ];

    // Weak scaling through srun (--mpi=pmix, or pmi2 for MPICH: jobs/common.sh chooses), every strategy.
    let mut env = common.to_vec();
    env.extend([("STRATEGIES", "ring ps allreduce horovod"), ("LAUNCH_EXTRA", "--overcommit"), ("STUDY_ID", "slurm-weak"), ("BATCH", "8")]);
    let log = slurm.submit("jobs/weak_scaling.sbatch", &env, &NODE, &dir.join("weak.out"));
    assert!(log.contains("skipping ps at 1 rank"), "{log}");
    // Strong scaling through mpirun inside the allocation.
    let mut env = common.to_vec();
    env.extend([("STRATEGIES", "ring horovod"), ("LAUNCHER", "mpirun"), ("LAUNCH_EXTRA", launcher::oversubscribe()), ("STUDY_ID", "slurm-strong"), ("GLOBAL_BATCH", "16")]);
    slurm.submit("jobs/strong_scaling.sbatch", &env, &NODE, &dir.join("strong.out"));
    // The exchange benchmark.
    let mut env = common.to_vec();
    env.extend([("STRATEGIES", "ring allreduce"), ("BENCH_DEVICE", "cpu"), ("MAX_BYTES", "64K"), ("ITERS", "2"), ("LAUNCH_EXTRA", "--overcommit"), ("RANK_COUNTS", "2"), ("STUDY_ID", "slurm-bench")]);
    slurm.submit("jobs/bench.sbatch", &env, &NODE, &dir.join("bench.out"));

    // Pipeline and hybrid layouts: one pipeline of two stages and two plain replicas.
    let mut env = common.to_vec();
    env.extend([("STRATEGIES", "ring"), ("LAUNCH_EXTRA", "--overcommit"), ("RANK_COUNTS", "2"), ("STUDY_ID", "slurm-pipeline"), ("BATCH", "8"), ("PIPELINE_STAGES", "1 2"), ("MICRO_BATCHES", "4"), ("PARTITION", "params")]);
    slurm.submit("jobs/pipeline.sbatch", &env, &NODE, &dir.join("pipeline.out"));

    let runs = read_runs(&results);
    // The job files ran the binary under test, with its own MPI's launchers.
    let library = match launcher::mpi() {
        launcher::Mpi::OpenMpi => "Open MPI",
        launcher::Mpi::Mpich => "MPICH",
    };
    assert!(runs.iter().all(|r| r["mpi_library"].as_str().is_some_and(|l| l.contains(library))), "{runs:#?}");
    let weak: Vec<_> = runs.iter().filter(|r| r["study"] == "slurm-weak").collect();
    let strong: Vec<_> = runs.iter().filter(|r| r["study"] == "slurm-strong").collect();
    // ring, allreduce, horovod at 1 and 2 ranks, ps at 2 only.
    assert_eq!(weak.len(), 7, "{weak:#?}");
    assert_eq!(strong.len(), 4);
    assert!(strong.iter().all(|r| r["global_batch"] == 16 && r["scaling"] == "strong"));
    assert!(weak.iter().any(|r| r["strategy"] == "ps" && r["ranks"] == 2));
    let piped: Vec<_> = runs.iter().filter(|r| r["study"] == "slurm-pipeline").collect();
    assert_eq!(piped.len(), 2, "{piped:#?}");
    assert!(piped.iter().any(|r| r["pipeline"]["pipeline_stages"] == 2 && r["pipeline"]["micro_batches"] == 4), "{piped:#?}");
    assert!(piped.iter().any(|r| r.get("pipeline").is_none() && r["workers"] == 2), "{piped:#?}");
    let bench = std::fs::read_to_string(results.join("bench.jsonl")).unwrap();
    assert!(bench.lines().count() >= 8, "{bench}");
    for study in ["slurm-weak", "slurm-strong"] {
        let report = results.join(format!("report-{study}/report.md"));
        assert!(report.exists(), "{} missing", report.display());
    }

    // A launch that exits 0 without training (srun did, for a step whose PMIx directory it could
    // not make): --print-config ends the run at once, status 0, no record. The job counts the
    // point as failed, not as run, and exits non-zero.
    let mut env = common.to_vec();
    env.extend([("STRATEGIES", "ring"), ("RANK_COUNTS", "1"), ("LAUNCH_EXTRA", "--overcommit"), ("STUDY_ID", "slurm-unlaunched"), ("EXTRA_ARGS", "--no-eval --threads 1 --print-config")]);
    let (run, log) = slurm.submit_any("jobs/weak_scaling.sbatch", &env, &NODE, &dir.join("unlaunched.out"));
    assert!(!run.ok() || !log.contains("every point ran"), "{log}");
    assert!(log.contains("== ring-1: the launcher exited 0 but the run wrote no record") && log.contains("point(s) failed: ring-1"), "{log}");
}

/// `--signal=B:USR1@300` and `--requeue`, as the job files have them: USR1 sent to the batch
/// shell (as Slurm does before the time limit) reaches the running point, which writes a
/// checkpoint and exits 143; the job requeues itself, and its next run continues that point from
/// the checkpoint and finishes the study.
#[test]
fn a_signalled_job_requeues_itself_and_resumes() {
    let dir = scratch("slurm-requeue");
    let Some(slurm) = LocalSlurm::start(&dir.join("cluster")) else { return };
    let data = synth(&dir, "requeue", 400, 40, "1x16x16", 4);
    let results = dir.join("results");
    let log = dir.join("job.out");
    // Rank 0 sleeps 1 s before each exchange of steps 2-13: the point trains long enough to be
    // signalled, and the requeued run, which resumes after its stop step, sleeps through the rest.
    let stalls: Vec<String> = (2..14).map(|step| format!("stall@0:{step}:1")).collect();
    let mut cmd = Command::new("sbatch");
    cmd.arg("--parsable")
        .args(NODE)
        .arg(format!("--output={}", log.display()))
        .arg(root().join("jobs/weak_scaling.sbatch"))
        .current_dir(root())
        .env("SLURM_CONF", &slurm.conf)
        .env("HPC_TRAIN", bin())
        .env("HPC_TRAIN_FAULT", stalls.join(","))
        .envs([
            ("RESULTS", results.to_str().unwrap()), ("DATA", data.to_str().unwrap()), ("PRESET", ""), ("MODEL", "tiny"),
            ("STEPS", "16"), ("BATCH", "8"), ("GPUS_PER_RANK", "0"), ("RANK_COUNTS", "2"), ("STRATEGIES", "ring"),
            ("EXTRA_ARGS", "--no-eval --threads 1"), ("STUDY_ID", "requeue"), ("JOB_LOG", ""), ("LAUNCH_EXTRA", "--overcommit"),
        ]);
    let submitted = run_with_limit(cmd, Duration::from_secs(60)).expect_ok();
    let id = submitted.stdout.trim().split(';').next().unwrap().to_string();
    let slurm_cmd = |tool: &str, args: &[&str]| {
        let mut cmd = Command::new(tool);
        cmd.args(args).env("SLURM_CONF", &slurm.conf);
        run_with_limit(cmd, Duration::from_secs(30))
    };
    let job = || {
        let shown = slurm_cmd("scontrol", &["show", "job", "--oneliner", &id]);
        let field = |name: &str| shown.stdout.split_whitespace().find_map(|w| w.strip_prefix(name)).unwrap_or("").to_string();
        (field("JobState="), field("Restarts="), field("ExitCode="))
    };
    let text = |path: &Path| std::fs::read_to_string(path).unwrap_or_default();
    let point_log = results.join("logs/requeue/ring-2.log");
    wait_until(Duration::from_secs(120), "the point to train", || text(&point_log).contains("steps 0.."));
    std::thread::sleep(Duration::from_secs(2));
    // What Slurm's --signal=B:USR1@300 does 300 s before the time limit.
    slurm_cmd("scancel", &["--signal=USR1", "--batch", &id]).expect_ok();
    let started = std::time::Instant::now();
    let mut requeued: Option<std::time::Instant> = None;
    let (state, restarts, code) = loop {
        let (state, restarts, code) = job();
        if ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"].contains(&state.as_str()) {
            break (state, restarts, code);
        }
        // Slurm holds a requeued job back for about two minutes (its begin time): start it now,
        // once the first run's step has gone. The requeued run's first step has the same id
        // (job.0): started while slurmd still ends the old one, srun said "aborted before step
        // completely launched" and exited 0 without running it, on a loaded machine.
        let old_steps_gone = || slurm_cmd("squeue", &["--steps", "--noheader", "--jobs", &id]).stdout.trim().is_empty();
        if state == "PENDING" && restarts != "0" && requeued.get_or_insert_with(std::time::Instant::now).elapsed() > Duration::from_secs(3) && old_steps_gone() {
            let _ = slurm_cmd("scontrol", &["update", &format!("JobId={id}"), "StartTime=now"]);
        }
        assert!(started.elapsed() < Duration::from_secs(300), "job {id} still {state}:\n{}\n--- point ---\n{}", text(&log), text(&point_log));
        std::thread::sleep(Duration::from_millis(300));
    };
    let (log, point) = (text(&log), text(&point_log));
    assert_eq!((state.as_str(), restarts.as_str(), code.as_str()), ("COMPLETED", "1", "0:0"), "{log}\n--- point ---\n{point}");
    assert!(log.contains("job received SIGUSR1") && log.contains("exit 143") && log.contains(&format!("requeueing job {id}")), "{log}");
    assert!(point.contains("resuming from"), "{point}");
    let points: Vec<serde_json::Value> = text(&results.join("points.jsonl")).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let tries: Vec<(i64, bool, i64)> = points.iter().map(|p| (p["exit_code"].as_i64().unwrap(), p["stopped"].as_bool().unwrap(), p["restart"].as_i64().unwrap())).collect();
    assert_eq!(tries, vec![(143, true, 0), (0, false, 1)], "{points:#?}");
    let runs = read_runs(&results);
    assert_eq!(runs.len(), 1, "{runs:#?}");
    assert!(results.join("report-requeue/report.md").is_file(), "{log}");
}
