//! Which MPI library hpc-train was built against and which one it runs with, and what the two
//! families of MPI libraries do differently: Open MPI, and MPICH with the libraries built on it
//! that share its ABI (Cray MPICH, Intel MPI, MVAPICH2).
//!
//! build.rs reads the family and version from the mpi.h the binary is compiled with; at run time
//! `MPI_Get_library_version` names the library really loaded. Both go into `hpc-train --version`.
//! At start, [`check_launch`] refuses the two mistakes that otherwise pass unnoticed: a binary
//! whose parts come from two MPI libraries, and a launcher of another MPI, which starts every
//! process as a job of its own (exit 0, each rank training alone).

use std::path::PathBuf;

use mpi::topology::{Communicator, SimpleCommunicator};

use crate::error::{Error, Result};

/// The library and version of the mpi.h hpc-train was compiled with, and how it was found.
pub const BUILT_AGAINST: &str = env!("HPC_TRAIN_MPI_BUILT");

/// [`BUILT_AGAINST`] without how it was found: "MPICH 4.0.2".
fn built_library() -> &'static str {
    BUILT_AGAINST.split(" (").next().unwrap_or(BUILT_AGAINST)
}

/// A family of MPI libraries: the same launchers, environment and behaviour within one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    OpenMpi,
    /// MPICH and its derivatives (Cray MPICH, Intel MPI, MVAPICH2).
    Mpich,
    Unknown,
}

impl Family {
    /// The family of the mpi.h hpc-train was built with.
    pub fn built() -> Family {
        match env!("HPC_TRAIN_MPI_FAMILY") {
            "openmpi" => Family::OpenMpi,
            "mpich" => Family::Mpich,
            _ => Family::Unknown,
        }
    }

    /// The family of the library that `MPI_Get_library_version` describes.
    pub fn of_library_version(version: &str) -> Family {
        if version.contains("Open MPI") {
            Family::OpenMpi
        } else if ["MPICH", "MVAPICH", "Intel(R) MPI"].iter().any(|name| version.contains(name)) {
            Family::Mpich
        } else {
            Family::Unknown
        }
    }

    /// The family of the library this process runs with.
    pub fn running() -> Family {
        Family::of_library_version(&full_library_version())
    }

    /// How to launch a binary of this family, for error messages.
    fn launchers(self) -> &'static str {
        match self {
            Family::OpenMpi => "Open MPI's mpirun (Debian: mpirun.openmpi) or srun --mpi=pmix",
            Family::Mpich => "the MPICH family's mpiexec (Hydra; Debian: mpiexec.mpich) or srun --mpi=pmi2",
            Family::Unknown => "the launcher of the MPI library it was built against",
        }
    }
}

/// `MPI_Get_library_version`'s whole text. The MPI standard lets it be called before
/// `MPI_Init` (and `hpc-train --version` does, so that it needs no launcher).
fn full_library_version() -> String {
    mpi::environment::library_version().unwrap_or_default()
}

/// The library this process runs with, in one line: the first line (up to the first comma) of
/// `MPI_Get_library_version`, spaces and tabs collapsed ("Open MPI v4.1.4", "MPICH Version:
/// 4.0.2"); "unknown" when it says nothing.
pub fn runtime_library() -> String {
    first_line(&full_library_version())
}

fn first_line(version: &str) -> String {
    let line = version.split([',', '\n']).next().unwrap_or("");
    let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.is_empty() { "unknown".into() } else { line }
}

/// The file of the MPI library mapped into this process (libmpi.so.40, libmpich.so.12...), from
/// /proc/self/maps.
fn loaded_library_file() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.rsplit('/').next().is_some_and(|name| name.starts_with("libmpi") && name.contains(".so")))
        .map(str::to_string)
}

/// What `hpc-train --version` prints: the program, the MPI library it was built against and the
/// one it runs with.
pub fn version_text() -> String {
    let file = loaded_library_file().map(|f| format!(" ({f})")).unwrap_or_default();
    format!(
        "hpc-train {} (commit {})\nMPI built against: {BUILT_AGAINST}\nMPI runs with:     {}{file}\n",
        env!("CARGO_PKG_VERSION"),
        env!("HPC_TRAIN_GIT_COMMIT"),
        runtime_library(),
    )
}

/// Variables through which launchers tell a process how many processes they started together.
/// PMIx has none of its own (a PMIx client asks its server): under `srun --mpi=pmix` the size
/// comes from Slurm's variable, under Open MPI's mpirun from Open MPI's.
const LAUNCHER_SIZE_VARIABLES: [(&str, &str); 4] = [
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH2's mpirun_rsh"),
    // Set in the tasks of a job step (srun), whatever its --mpi, and only there: a batch script
    // is one process, although it sees the allocation's SLURM_NTASKS (seen under Slurm 22.05).
    ("SLURM_STEP_NUM_TASKS", "Slurm's srun"),
];

/// Variables through which launchers tell a process its rank, the innermost launcher's first:
/// an MPI library's own launcher may run inside a Slurm job, whose SLURM_PROCID it inherits.
const LAUNCHER_RANK_VARIABLES: [&str; 5] = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID"];

/// How many processes the launcher started together, as far as its variables say: the largest
/// size it gives, or one more than the largest rank (a PMIx launcher may give only the rank); 1
/// without a launcher.
pub fn launched_processes() -> i32 {
    launched_processes_in(|var| std::env::var(var).ok())
}

/// [`launched_processes`] in the environment `lookup` reads.
fn launched_processes_in(lookup: impl Fn(&str) -> Option<String>) -> i32 {
    let number = |var: &str| lookup(var)?.trim().parse::<i32>().ok();
    let sizes = LAUNCHER_SIZE_VARIABLES.iter().filter_map(|&(var, _)| number(var));
    let ranks = LAUNCHER_RANK_VARIABLES.iter().filter_map(|&var| number(var)?.checked_add(1));
    sizes.chain(ranks).max().unwrap_or(1).max(1)
}

/// This process's rank as its launcher set it (Open MPI, MPICH/Hydra, PMIx, MVAPICH2, Slurm), for
/// deciding who prints before MPI is initialised; 0 without a launcher.
pub fn launcher_rank() -> i32 {
    LAUNCHER_RANK_VARIABLES.iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok()).unwrap_or(0)
}

/// Refuses, with one line, a start that cannot give the job the user asked for: a binary whose
/// mpi.h and loaded library belong to different families (a target folder rebuilt with another
/// MPI), or a launcher that started more processes than MPI put into the world (the launcher of
/// another MPI, or srun with the wrong `--mpi`: each process is then a job of one rank).
/// Collective-free: every process decides alone, from what it sees.
pub fn check_launch(world: &SimpleCommunicator) -> Result<()> {
    let version = full_library_version();
    let (built, running) = (Family::built(), Family::of_library_version(&version));
    if built != Family::Unknown && running != Family::Unknown && built != running {
        return Err(Error::usage(format!(
            "hpc-train was built against {} but runs with {}: a binary from two MPI libraries (a target folder rebuilt \
             with another MPICC); build each MPI into its own target folder (docs/mpi.md, \"One target folder per MPI\")",
            built_library(),
            first_line(&version)
        )));
    }
    let launched: Vec<(&str, &str, i32)> = LAUNCHER_SIZE_VARIABLES
        .iter()
        .filter_map(|&(var, launcher)| Some((var, launcher, std::env::var(var).ok()?.trim().parse::<i32>().ok()?)))
        .collect();
    launch_mismatch(&launched, world.size(), built, &first_line(&version)).map_or(Ok(()), |message| Err(Error::usage(message)))
}

/// The refusal for a launch whose launcher variables (name, launcher, size) all disagree with
/// the world's size, or None when there are none or one agrees (an outer launcher's variables may
/// linger in the environment of an inner one).
fn launch_mismatch(launched: &[(&str, &str, i32)], world_size: i32, built: Family, library: &str) -> Option<String> {
    if launched.is_empty() || launched.iter().any(|&(_, _, size)| size == world_size) {
        return None;
    }
    let (var, launcher, size) = launched[0];
    Some(format!(
        "{launcher} started {size} processes ({var}={size}), but {library} made this one a job of {world_size} rank(s): \
         the launcher, or srun's --mpi plugin, does not belong to the MPI library hpc-train was built against ({}); launch it \
         with {}",
        built_library(),
        built.launchers()
    ))
}

/// Whether the MPI library reads GPU memory, as far as it says: MPICH 4's
/// `MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)`, else `MPIX_Query_cuda_support` (Open MPI,
/// MPICH) checked against Open MPI's run-time switch (below), else MVAPICH2's own switch
/// `MV2_USE_CUDA=1`. A library that answers none of them gets GPU buffers staged through host
/// memory, and rank 0 logs so.
///
/// Open MPI 4.1's `MPIX_Query_cuda_support()` returns a constant of its build: 1 also in a run
/// where it turned its CUDA support off (libcuda not found, `--mca mpi_cuda_support 0`), and a
/// GPU rank that believed it would hand device pointers to an MPI that reads them as host
/// memory. Its control variable `mpi_cuda_support` says the run's state (seen on the
/// development VM, 2026-11-27: the bundle's CUDA-aware build answers 1 and the variable 0).
///
/// Asked once per process (a study's or `conform`'s runs share the answer): the library's
/// answer cannot change after MPI_Init. The control variable is read only where the build-time
/// query says yes, the one case it can overturn: reading it opens the MPI tool interface, which
/// in Open MPI 4.1 loads and initialises every component (about 0.15 s on the development VM,
/// mostly the PSM and OFI transports' start-up sleeps), and every run paid that.
pub fn cuda_aware() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(ask_cuda_aware)
}

fn ask_cuda_aware() -> bool {
    let library = runtime_library();
    let answer = decide_cuda(
        crate::raw::mpix_gpu_query_support_cuda(),
        crate::raw::mpi_cuda_support(),
        || crate::raw::int_control_variable("mpi_cuda_support").map(|v| v != 0),
        &library,
        std::env::var("MV2_USE_CUDA").ok().as_deref(),
    );
    match answer {
        CudaAnswer::Known { aware, how } => {
            log::debug!("CUDA-aware MPI: {} ({library}: {how})", if aware { "yes" } else { "no" });
            aware
        }
        CudaAnswer::Unknown => {
            log::info!(
                "{library} answers no CUDA-awareness query (MPIX_GPU_query_support, MPIX_Query_cuda_support, MVAPICH2's \
                 MV2_USE_CUDA): GPU buffers are staged through host memory; --cuda-aware yes if it reads GPU memory"
            );
            false
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum CudaAnswer {
    Known { aware: bool, how: String },
    Unknown,
}

/// `switched_on`: reads Open MPI's run-time control variable `mpi_cuda_support`, where the library
/// has it; called only when `cuda_query` says yes.
fn decide_cuda(gpu_query: Option<bool>, cuda_query: Option<bool>, switched_on: impl FnOnce() -> Option<bool>, library: &str, mv2_use_cuda: Option<&str>) -> CudaAnswer {
    if let Some(aware) = gpu_query {
        return CudaAnswer::Known { aware, how: format!("MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) = {}", u8::from(aware)) };
    }
    if let Some(aware) = cuda_query {
        if aware && switched_on() == Some(false) {
            return CudaAnswer::Known {
                aware: false,
                how: "MPIX_Query_cuda_support() = 1 (built with CUDA support), but its control variable mpi_cuda_support = 0: \
                      it turned the support off in this run (libcuda not loaded, or --mca mpi_cuda_support 0)"
                    .into(),
            };
        }
        return CudaAnswer::Known { aware, how: format!("MPIX_Query_cuda_support() = {}", u8::from(aware)) };
    }
    if library.contains("MVAPICH") {
        // MVAPICH2 (-GDR) reads device buffers only when started with MV2_USE_CUDA=1.
        let aware = mv2_use_cuda.is_some_and(|v| v.trim() == "1");
        return CudaAnswer::Known { aware, how: format!("MV2_USE_CUDA={}", mv2_use_cuda.unwrap_or("(unset)")) };
    }
    CudaAnswer::Unknown
}

/// The folder whose file system holds the files behind MPI-3 shared windows
/// (`MPI_Win_allocate_shared`): Open MPI's `osc_sm_backing_directory` (/dev/shm unless set
/// through `OMPI_MCA_osc_sm_backing_directory`); the MPICH family maps them from /dev/shm, with
/// no setting to move them (it falls back to /tmp only where /dev/shm cannot hold a file).
pub fn shared_window_directory() -> PathBuf {
    let dev_shm = PathBuf::from("/dev/shm");
    match Family::running() {
        Family::OpenMpi => std::env::var_os("OMPI_MCA_osc_sm_backing_directory").map_or(dev_shm, PathBuf::from),
        _ if dev_shm.is_dir() => dev_shm,
        _ => std::env::temp_dir(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_are_sorted_into_their_families() {
        let open_mpi = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\0";
        assert_eq!(Family::of_library_version(open_mpi), Family::OpenMpi);
        assert_eq!(first_line(open_mpi), "Open MPI v4.1.4");
        let mpich = "MPICH Version:\t4.0.2\nMPICH Release date:\tThu Apr  7 12:34:45 CDT 2022\nMPICH ABI:\t14:2:2\n";
        assert_eq!(Family::of_library_version(mpich), Family::Mpich);
        assert_eq!(first_line(mpich), "MPICH Version: 4.0.2");
        for derivative in [
            "MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)\nMPI BUILD INFO : ...",
            "Intel(R) MPI Library 2021.6 for Linux* OS\n",
            "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022\n",
        ] {
            assert_eq!(Family::of_library_version(derivative), Family::Mpich, "{derivative}");
        }
        assert_eq!(Family::of_library_version("Microsoft MPI 10.1"), Family::Unknown);
        assert_eq!(first_line(""), "unknown");
    }

    #[test]
    fn the_build_records_a_known_family() {
        assert_ne!(Family::built(), Family::Unknown, "{BUILT_AGAINST}");
        assert!(BUILT_AGAINST.contains("family; found by"), "{BUILT_AGAINST}");
    }

    #[test]
    fn a_launcher_is_refused_only_when_no_size_it_gives_matches_the_world() {
        let open_mpi = [("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", 4)];
        // An MPICH binary under Open MPI's mpirun: four singletons.
        let message = launch_mismatch(&open_mpi, 1, Family::Mpich, "MPICH Version: 4.0.2").expect("refused");
        assert!(message.starts_with("Open MPI's mpirun started 4 processes (OMPI_COMM_WORLD_SIZE=4), but MPICH Version: 4.0.2 made this one a job of 1 rank(s)"), "{message}");
        assert!(message.contains("mpiexec.mpich"), "{message}");
        assert_eq!(launch_mismatch(&open_mpi, 4, Family::OpenMpi, "Open MPI v4.1.4"), None);
        // No launcher at all (a singleton started by hand).
        assert_eq!(launch_mismatch(&[], 1, Family::Mpich, "MPICH"), None);
        // An outer launcher's variable left in the environment of a job that an inner one started.
        let nested = [("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", 1), ("PMI_SIZE", "a PMI launcher", 2)];
        assert_eq!(launch_mismatch(&nested, 2, Family::Mpich, "MPICH"), None);
        // srun whose --mpi plugin the library does not speak: each task a job of its own.
        let srun = [("SLURM_STEP_NUM_TASKS", "Slurm's srun", 2)];
        let message = launch_mismatch(&srun, 1, Family::OpenMpi, "Open MPI v4.1.4").expect("refused");
        assert!(message.starts_with("Slurm's srun started 2 processes (SLURM_STEP_NUM_TASKS=2), but Open MPI v4.1.4 made this one a job of 1 rank(s)"), "{message}");
        assert!(message.contains("srun --mpi=pmix"), "{message}");
    }

    /// A serial command (`report`, `compat`) starts MPI, for rank 0 alone to work, only where
    /// the environment says that several processes were launched together. Under `srun
    /// --mpi=pmix` only Slurm's and PMIx's variables say so, and each of 8 tasks wrote the same
    /// report. Environments as Slurm 22.05 and Open MPI 4.1 set them.
    #[test]
    fn launched_processes_are_counted_from_every_launcher_variable() {
        let count = |env: &[(&str, &str)]| launched_processes_in(|var| env.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string()));
        assert_eq!(count(&[]), 1, "no launcher");
        let srun_pmix = [("SLURM_STEP_NUM_TASKS", "8"), ("SLURM_NTASKS", "8"), ("SLURM_PROCID", "3"), ("PMIX_RANK", "3"), ("PMIX_NAMESPACE", "slurm.pmix.1.0")];
        assert_eq!(count(&srun_pmix), 8);
        // A batch script: one process, though it sees the allocation's task count.
        assert_eq!(count(&[("SLURM_NTASKS", "2"), ("SLURM_NPROCS", "2"), ("SLURM_PROCID", "0")]), 1);
        // A launcher that gives a rank and no size: at least that many.
        assert_eq!(count(&[("PMIX_RANK", "2")]), 3);
        assert_eq!(count(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "1"), ("PMIX_RANK", "1")]), 4);
        assert_eq!(count(&[("PMI_SIZE", "2"), ("PMI_RANK", "0")]), 2);
        assert_eq!(count(&[("PMI_SIZE", "two"), ("PMI_RANK", " 1 ")]), 2, "a number with spaces counts, anything else not");
        assert_eq!(count(&[("PMI_SIZE", "-3")]), 1);
    }

    #[test]
    fn cuda_awareness_is_asked_in_order_and_unknown_means_staged() {
        let known = |aware: bool, how: &str| CudaAnswer::Known { aware, how: how.into() };
        // MPICH 4: the GPU query answers first.
        assert_eq!(decide_cuda(Some(false), Some(true), || None, "MPICH Version: 4.0.2", None), known(false, "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) = 0"));
        // Open MPI: MPIX_Query_cuda_support, unless its run-time switch is off.
        assert_eq!(decide_cuda(None, Some(true), || None, "Open MPI v5.0.3", None), known(true, "MPIX_Query_cuda_support() = 1"));
        assert_eq!(decide_cuda(None, Some(true), || Some(true), "Open MPI v4.1.4", None), known(true, "MPIX_Query_cuda_support() = 1"));
        match decide_cuda(None, Some(true), || Some(false), "Open MPI v4.1.4", None) {
            CudaAnswer::Known { aware: false, how } => assert!(how.contains("mpi_cuda_support = 0"), "{how}"),
            other => panic!("a build with CUDA support that turned it off is not CUDA-aware: {other:?}"),
        }
        assert_eq!(decide_cuda(None, Some(false), || Some(true), "Open MPI v4.1.4", None), known(false, "MPIX_Query_cuda_support() = 0"));
        // MVAPICH2(-GDR): its switch.
        assert_eq!(decide_cuda(None, None, || None, "MVAPICH2 Version : 2.3.7", Some("1")), known(true, "MV2_USE_CUDA=1"));
        assert_eq!(decide_cuda(None, None, || None, "MVAPICH2 Version : 2.3.7", None), known(false, "MV2_USE_CUDA=(unset)"));
        assert_eq!(decide_cuda(None, None, || None, "Some MPI 1.0", Some("1")), CudaAnswer::Unknown);
        // The control variable (an expensive read: the whole tool interface) is read only where
        // the build-time query says yes.
        let never = || -> Option<bool> { panic!("mpi_cuda_support read without need") };
        assert_eq!(decide_cuda(None, Some(false), never, "Open MPI v4.1.4", None), known(false, "MPIX_Query_cuda_support() = 0"));
        assert_eq!(decide_cuda(Some(true), Some(true), never, "MPICH Version: 4.1", None), known(true, "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) = 1"));
    }
}
