//! The MPI library hpc-train is built against and the one it runs with: `--version` names both
//! without a launcher, a launcher of another MPI library is refused in one line instead of
//! running every process as a job of its own, and the CUDA-awareness query is the one the
//! library has. Runs with the binary of either family (scripts/test.sh runs it with both).

mod common;

use std::process::Command;
use std::time::Duration;

use common::launcher::{self, Mpi};
use common::*;

/// What the family is called in `--version` and in MPI_Get_library_version's text.
fn names(mpi: Mpi) -> (&'static str, &'static str) {
    match mpi {
        Mpi::OpenMpi => ("openmpi family", "Open MPI"),
        Mpi::Mpich => ("mpich family", "MPICH"),
    }
}

#[test]
fn version_names_the_mpi_built_against_and_the_one_loaded_without_a_launcher() {
    let run = hpc_train(&["--version"]).expect_ok();
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
    let (family, library) = names(launcher::mpi());
    let line = |prefix: &str| run.stdout.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix:?} line:\n{}", run.stdout)).to_string();
    let built = line("MPI built against: ");
    assert!(built.contains(family) && built.contains(library), "{built}");
    let runs = line("MPI runs with: ");
    assert!(runs.contains(library) && runs.contains(".so"), "{runs}");
    assert!(run.stdout.starts_with("hpc-train "), "{}", run.stdout);
}

#[test]
fn a_launcher_of_another_mpi_is_refused_in_one_line() {
    let Some(other) = launcher::other_program() else {
        eprintln!("skipped: no launcher of another MPI library is installed");
        return;
    };
    let dir = scratch("other-launcher");
    let mut cmd = Command::new(other);
    cmd.args(["-n", "2"]);
    if other.contains("openmpi") {
        cmd.arg("--oversubscribe").env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd.arg(bin())
        .args(["bench", "--strategies", "ring", "--counts", "100", "--iters", "1", "--warmup", "0", "--results", dir.to_str().unwrap()])
        .current_dir(root());
    let run = run_with_limit(cmd, Duration::from_secs(120));
    let text = run.all_output();
    assert!(!run.ok() && !run.timed_out, "{other} ran a binary of another MPI ({:?}):\n{text}", run.status);
    let refusals: Vec<&str> = text.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(refusals.len(), 1, "{text}");
    assert!(refusals[0].contains("started 2 processes") && refusals[0].contains("does not belong to the MPI library"), "{text}");
    // It names the launcher to use instead.
    let wanted = match launcher::mpi() {
        Mpi::OpenMpi => "mpirun",
        Mpi::Mpich => "mpiexec",
    };
    assert!(refusals[0].contains(wanted), "{text}");
    assert!(!dir.join("bench.jsonl").exists(), "a refused launch wrote results");
}

#[test]
fn cuda_awareness_is_asked_with_the_query_the_library_has() {
    let dir = scratch("cuda-query");
    let args = ["bench", "--strategies", "allreduce", "--counts", "100", "--iters", "1", "--warmup", "0", "--cuda-aware", "auto", "--results", dir.to_str().unwrap()];
    let run = mpirun_env(2, &args, &[("RUST_LOG", "debug")], Duration::from_secs(120)).expect_ok();
    // MPICH 4 answers its GPU query; Open MPI only MPIX_Query_cuda_support.
    let query = match launcher::mpi() {
        Mpi::OpenMpi => "MPIX_Query_cuda_support() = ",
        Mpi::Mpich => "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) = ",
    };
    let answers = run.stderr.lines().filter(|l| l.contains("CUDA-aware MPI: ") && l.contains(query)).count();
    assert_eq!(answers, 2, "every rank asks, with {query}:\n{}", run.stderr);
}
