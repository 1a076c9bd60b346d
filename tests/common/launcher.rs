//! The MPI launcher that tests start hpc-train with: the one of the MPI library the binary under
//! test was built against (build.rs records its family as `HPC_TRAIN_MPI_FAMILY`), with that
//! launcher's spelling of what the tests need.
//!
//! - Open MPI: `mpirun` (`mpirun.openmpi` where Debian installs both), as root
//!   (`OMPI_ALLOW_RUN_AS_ROOT*`), oversubscribed and unbound, since the test machine has fewer
//!   cores than ranks and ranks are multi-threaded.
//! - The MPICH family: Hydra's `mpiexec` (`mpiexec.mpich`), which needs none of that: it runs as
//!   root, has no slot limit and binds nothing unless asked (and refuses `--oversubscribe`).
//!
//! Both take MPMD launches (`... : -n 1 program args`) and pass the environment on to the ranks
//! they start on this machine. `HPC_TRAIN_MPIEXEC` names another launcher program of the same
//! family (e.g. Intel MPI's `mpiexec`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mpi {
    OpenMpi,
    Mpich,
}

/// The family of the MPI library the binary under test was built against: the one this test
/// binary was built beside, or `HPC_TRAIN_TEST_MPI_FAMILY` (`openmpi`, `mpich`) where it runs
/// another build of hpc-train (`HPC_TRAIN_TEST_BINARY`): the tests link no MPI, so
/// scripts/test.sh runs Open MPI's build of them against MPICH's hpc-train rather than compiling
/// them twice.
pub fn mpi() -> Mpi {
    let family = std::env::var("HPC_TRAIN_TEST_MPI_FAMILY").ok().filter(|f| !f.is_empty());
    match family.as_deref().unwrap_or(env!("HPC_TRAIN_MPI_FAMILY")) {
        "mpich" => Mpi::Mpich,
        "openmpi" => Mpi::OpenMpi,
        other => panic!("HPC_TRAIN_TEST_MPI_FAMILY={other}: expected openmpi or mpich"),
    }
}

/// Whether this run has every row of the expensive sweeps: Open MPI's run does. MPICH's run
/// (scripts/test.sh runs the suite under both) keeps, of each sweep, the rows whose outcome can
/// depend on the MPI library (its launcher, signals and aborts, its own collectives as the
/// reference, message matching at each kind of rank count) and leaves to Open MPI's run the
/// rows that repeat the same arithmetic at more rank counts, strategies or options: CI has 40
/// minutes on 2 cores for both runs and set-up, and MPICH's ranks poll without yielding, so
/// each oversubscribed launch costs it more than Open MPI.
pub fn every_row() -> bool {
    mpi() == Mpi::OpenMpi
}

/// `rows` under Open MPI; under MPICH only those `keep` selects (see [`every_row`]).
pub fn rows_under_mpich<T: Copy>(rows: &[T], keep: impl Fn(T) -> bool) -> Vec<T> {
    rows.iter().copied().filter(|&r| every_row() || keep(r)).collect()
}

/// The C compiler wrapper of the same MPI (for test fixtures built against it): `MPICC` (set by
/// scripts/env.sh for the chosen MPI), else the family's Debian name, else `mpicc`, which
/// Debian's alternatives may point at the other family.
pub fn compiler() -> OsString {
    if let Some(mpicc) = std::env::var_os("MPICC").filter(|p| !p.is_empty()) {
        return mpicc;
    }
    let name = match mpi() {
        Mpi::OpenMpi => "mpicc.openmpi",
        Mpi::Mpich => "mpicc.mpich",
    };
    OsString::from(if on_path(name) { name } else { "mpicc" })
}

/// Whether `program` is on PATH.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// The launcher program: `HPC_TRAIN_MPIEXEC`, else the first of the family's usual names on PATH.
pub fn program() -> OsString {
    if let Some(program) = std::env::var_os("HPC_TRAIN_MPIEXEC").filter(|p| !p.is_empty()) {
        return program;
    }
    let names: &[&str] = match mpi() {
        Mpi::OpenMpi => &["mpirun.openmpi", "mpirun"],
        Mpi::Mpich => &["mpiexec.mpich", "mpiexec.hydra", "mpiexec"],
    };
    let found = names.iter().find(|name| on_path(name)).unwrap_or(&names[names.len() - 1]);
    OsString::from(found)
}

/// The launcher of the other family where it is installed (for tests of a wrong launch).
pub fn other_program() -> Option<&'static str> {
    let names: &[&'static str] = match mpi() {
        Mpi::OpenMpi => &["mpiexec.mpich", "mpiexec.hydra"],
        Mpi::Mpich => &["mpirun.openmpi"],
    };
    names.iter().copied().find(|name| on_path(name))
}

/// `<launcher> -n <ranks>`, with the settings the tests need on this machine.
pub fn command(ranks: usize) -> Command {
    let mut cmd = Command::new(program());
    cmd.args(["-n", &ranks.to_string()]);
    if mpi() == Mpi::OpenMpi {
        cmd.args(["--oversubscribe", "--bind-to", "none"])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
            // Once a rank exits non-zero, Open MPI's daemon ends the job's other ranks with
            // SIGTERM, then SIGKILL, sleeping this long (1 s by default) before each, even
            // when they have all exited already: every launch that is meant to fail (a
            // refusal, a fault, an abort) took 2.3 s where it takes 0.3 (measured on the
            // 2-core VM, Open MPI 4.1.4). Hydra kills at once, and the suite passes under it,
            // so no test needs the grace.
            .env("OMPI_MCA_odls_base_sigkill_timeout", "0");
    }
    cmd
}

/// The launcher option that lets more ranks than cores run: Open MPI's `--oversubscribe`; none
/// for Hydra, which has no slot limit and refuses the option.
pub fn oversubscribe() -> &'static str {
    match mpi() {
        Mpi::OpenMpi => "--oversubscribe",
        Mpi::Mpich => "",
    }
}

/// Launcher options that place `per_node` consecutive ranks on each node (on a cluster whose
/// hosts the launcher knows, e.g. scripts/local-cluster.sh's).
pub fn per_node(per_node: usize) -> Vec<String> {
    match mpi() {
        Mpi::OpenMpi => vec!["--map-by".into(), format!("ppr:{per_node}:node")],
        Mpi::Mpich => vec!["-ppn".into(), per_node.to_string()],
    }
}

/// Launcher options that set `name=value` for every rank, on every node: Open MPI passes only
/// the variables it is told to other nodes' ranks; Hydra passes the whole environment, but
/// `-genv` says so explicitly.
pub fn export(name: &str, value: &str) -> Vec<String> {
    match mpi() {
        Mpi::OpenMpi => vec!["-x".into(), format!("{name}={value}")],
        Mpi::Mpich => vec!["-genv".into(), name.into(), value.into()],
    }
}

/// The variable in which the launcher gives each rank its number among its node's ranks.
pub fn local_rank_variable() -> &'static str {
    match mpi() {
        Mpi::OpenMpi => "OMPI_COMM_WORLD_LOCAL_RANK",
        Mpi::Mpich => "MPI_LOCALRANKID",
    }
}

/// Where a test mounts a small file system to stand for a node's small shared-memory file
/// system: Open MPI maps its shared windows in `dir` when `OMPI_MCA_osc_sm_backing_directory`
/// names it (the test sets it); the MPICH family always maps them from /dev/shm, so the mount
/// goes there (in a mount namespace of the test's own).
pub fn shared_memory_mount_point(dir: &Path) -> PathBuf {
    match mpi() {
        Mpi::OpenMpi => dir.to_path_buf(),
        Mpi::Mpich => PathBuf::from("/dev/shm"),
    }
}
