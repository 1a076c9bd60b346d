//! Helpers for tests that launch the real binary, under the MPI launcher or alone.
#![allow(dead_code)]

pub mod launcher;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

/// How many MPI jobs of one test binary run at once ([`job_slot`]).
static MPI_JOBS: JobSlots = JobSlots { taken: Mutex::new(0), freed: Condvar::new() };

struct JobSlots {
    taken: Mutex<usize>,
    freed: Condvar,
}

/// One of the MPI jobs a test binary may run at once, held until dropped. The machine has few
/// cores, so a binary's test threads share a few: `HPC_TRAIN_TEST_MPI_JOBS`, by default 2 under
/// Open MPI and 1 under MPICH. With one job at a time, Open MPI's test binaries kept the 2-core
/// VM only 50-70% busy (reliability: 142 s of wall time, 95 s of CPU): much of a launch waits,
/// for a watchdog's timeout, a signal's moment, start-up or teardown, and Open MPI's
/// oversubscribed ranks yield the core while they wait. MPICH's ranks poll without yielding, so
/// a second job there only takes cores from the first.
pub struct JobSlot;

pub fn job_slot() -> JobSlot {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    let limit = *LIMIT.get_or_init(|| match std::env::var("HPC_TRAIN_TEST_MPI_JOBS") {
        Ok(v) if !v.is_empty() => v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| panic!("HPC_TRAIN_TEST_MPI_JOBS={v}: expected a count of at least 1")),
        _ => match launcher::mpi() {
            launcher::Mpi::OpenMpi => 2,
            launcher::Mpi::Mpich => 1,
        },
    });
    let mut taken = MPI_JOBS.taken.lock().unwrap_or_else(|e| e.into_inner());
    while *taken >= limit {
        taken = MPI_JOBS.freed.wait(taken).unwrap_or_else(|e| e.into_inner());
    }
    *taken += 1;
    JobSlot
}

impl Drop for JobSlot {
    fn drop(&mut self) {
        *MPI_JOBS.taken.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        MPI_JOBS.freed.notify_one();
    }
}

/// HDF5 opens files without close-on-exec and locks them with flock(2). A child started while
/// another test thread of the same binary has an HDF5 file open inherits that descriptor, and
/// with it the lock, for as long as the child lives; a rank opening the file then fails with
/// "unable to lock file". Starting a child takes this lock shared (for the moment of the fork
/// only); holding an HDF5 file open in the test process takes it exclusive (`with_hdf5_open`).
static FORK: RwLock<()> = RwLock::new(());

/// Runs `f`, which opens (and closes) HDF5 files in the test process, while no child is started.
pub fn with_hdf5_open<T>(f: impl FnOnce() -> T) -> T {
    let _guard = FORK.write().unwrap_or_else(|e| e.into_inner());
    f()
}

/// Starts `cmd` (see `FORK`).
fn spawn(cmd: &mut Command) -> std::process::Child {
    let _guard = FORK.read().unwrap_or_else(|e| e.into_inner());
    cmd.spawn().unwrap_or_else(|e| panic!("starting {:?}: {e}", cmd.get_program()))
}

/// The hpc-train under test: cargo's build of it, or `HPC_TRAIN_TEST_BINARY` where a test binary
/// runs away from the tree it was built in (scripts/device-check.sh runs tests/gpu.rs from the
/// bundle of scripts/pack.sh on a machine without Rust).
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| relocated("HPC_TRAIN_TEST_BINARY").unwrap_or_else(|| env!("CARGO_BIN_EXE_hpc-train").into()))
}

/// Repository root (datasets/, results/ are relative to it): the one built in, or
/// `HPC_TRAIN_TEST_ROOT` (see `bin`).
/// True, after saying so, where the test's subject does not depend on the MPI library and the
/// first MPI's run (Open MPI's) has covered it: the file logic of checkpoints, the arithmetic
/// of optimizers. scripts/test.sh runs the suite under both; this keeps the second run to what
/// MPICH can change (CI's time limit, README "MPI libraries").
#[allow(dead_code)]
pub fn covered_by_the_first_mpi(what: &str) -> bool {
    let second = launcher::mpi() == launcher::Mpi::Mpich;
    if second {
        eprintln!("skipped under MPICH: {what} does not depend on the MPI library, and Open MPI's run covers it");
    }
    second
}

pub fn root() -> PathBuf {
    PathBuf::from(relocated("HPC_TRAIN_TEST_ROOT").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()))
}

fn relocated(variable: &str) -> Option<String> {
    std::env::var(variable).ok().filter(|path| !path.is_empty())
}

/// A fresh folder for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hpc-train-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub struct Run {
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub timed_out: bool,
}

impl Run {
    pub fn ok(&self) -> bool {
        self.status == Some(0)
    }

    /// Panics with the output when the run failed.
    pub fn expect_ok(self) -> Run {
        assert!(self.ok(), "run failed ({:?}, timed out: {}):\nstdout:\n{}\nstderr:\n{}", self.status, self.timed_out, self.stdout, self.stderr);
        self
    }

    pub fn all_output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs `cmd`, killing it after `limit`.
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> Run {
    let run = run_once(&mut cmd, limit);
    if open_mpi_session_directory_race(&run) {
        // Open MPI 4.1 can fail to start when the job before it is still removing the session
        // directory both use (/tmp/ompi.<host>.<uid>): mkdir reports "File exists". Nothing
        // ran; the launch is made again, once.
        std::thread::sleep(Duration::from_secs(1));
        return run_once(&mut cmd, limit);
    }
    run
}

/// Whether a launch failed before any rank started, in Open MPI's race on its session directory.
fn open_mpi_session_directory_race(run: &Run) -> bool {
    !run.ok() && run.stderr.contains("A call to mkdir was unable to create the desired directory") && run.stderr.contains("File exists")
}

fn run_once(cmd: &mut Command, limit: Duration) -> Run {
    let start = Instant::now();
    let mut child = spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()));
    // Read the pipes in threads so that a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || { let mut s = String::new(); let _ = std::io::Read::read_to_string(&mut out, &mut s); s });
    let err_t = std::thread::spawn(move || { let mut s = String::new(); let _ = std::io::Read::read_to_string(&mut err, &mut s); s });
    let (status, timed_out) = match wait_limited(&mut child, limit) {
        Some((code, _)) => (code, false),
        None => (None, true),
    };
    Run { status, stdout: out_t.join().unwrap(), stderr: err_t.join().unwrap(), elapsed: start.elapsed(), timed_out }
}

/// `mpirun -n <ranks> hpc-train <args>` (the launcher of the MPI hpc-train was built against,
/// see [`launcher`]) with the settings tests need (root, oversubscription), killed after `limit`.
pub fn mpirun_env(ranks: usize, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Run {
    let _slot = job_slot();
    run_with_limit(mpirun_command(ranks, args, env), limit)
}

/// The launcher's command line tests launch hpc-train with: as root, oversubscribed, unbound (the
/// test machine has fewer cores than ranks), in the repository root, plus `env`.
fn mpirun_command(ranks: usize, args: &[&str], env: &[(&str, &str)]) -> Command {
    mpirun_command_of(ranks, &[std::ffi::OsStr::new(bin())], args, env)
}

/// As [`mpirun_command`], each rank running `program` (a program and its first arguments).
fn mpirun_command_of(ranks: usize, program: &[&std::ffi::OsStr], args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = launcher::command(ranks);
    cmd.args(program).args(args).current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// As [`mpirun_env`], each rank started as `<wrapper> <hpc-train> <args>`: a script that sets
/// up a rank's environment the way a launcher would (e.g. a per-rank CUDA_VISIBLE_DEVICES).
pub fn mpirun_wrapped(ranks: usize, wrapper: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Run {
    let _slot = job_slot();
    run_with_limit(mpirun_command_of(ranks, &[wrapper.as_os_str(), std::ffi::OsStr::new(bin())], args, env), limit)
}

/// As [`mpirun_env`], in a mount namespace of its own (`unshare --mount`, root) in which a
/// tmpfs of `size` (e.g. "16m") is mounted first where the MPI library maps its shared windows:
/// on `dir` for Open MPI (which `OMPI_MCA_osc_sm_backing_directory` in `env` names), on /dev/shm
/// for the MPICH family (see [`launcher::shared_memory_mount_point`]): a small file system for
/// tests of what hpc-train does when one runs full. The mount goes with the namespace when the
/// launcher ends.
pub fn mpirun_with_tmpfs(ranks: usize, args: &[&str], env: &[(&str, &str)], dir: &Path, size: &str, limit: Duration) -> Run {
    let _slot = job_slot();
    std::fs::create_dir_all(dir).unwrap();
    let mount_point = launcher::shared_memory_mount_point(dir);
    let inner = mpirun_command(ranks, args, env);
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c", r#"mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@""#, "sh", size])
        .arg(&mount_point)
        .arg(inner.get_program())
        .args(inner.get_args())
        .current_dir(root());
    for (k, v) in inner.get_envs() {
        if let Some(v) = v {
            cmd.env(k, v);
        }
    }
    run_with_limit(cmd, limit)
}

/// Marks the end of a command's output and the start of the tmpfs listing.
const TMPFS_LISTING: &str = "@@ left in the tmpfs:";

/// Runs `cmd` as [`mpirun_with_tmpfs`] does (a tmpfs of `size` on `dir`, in a mount namespace
/// that goes when it ends), then lists what is left in the tmpfs (paths relative to `dir`,
/// sorted): the files a failed write left behind can only be seen from inside.
fn with_tmpfs_listing(cmd: Command, dir: &Path, size: &str, limit: Duration) -> (Run, Vec<String>) {
    std::fs::create_dir_all(dir).unwrap();
    let script = format!(
        r#"mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97; d=$2; shift 2; "$@"; rc=$?; echo "{TMPFS_LISTING}"; (cd "$d" && find . -mindepth 1 | sort); exit $rc"#
    );
    let mut outer = Command::new("unshare");
    outer.args(["--mount", "--propagation", "private", "sh", "-c", &script, "sh", size]).arg(dir).arg(cmd.get_program()).args(cmd.get_args()).current_dir(root());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            outer.env(k, v);
        }
    }
    let mut run = run_with_limit(outer, limit);
    assert_ne!(run.status, Some(97), "could not mount a tmpfs (root and mount namespaces needed):\n{}", run.all_output());
    let (output, listing) = run.stdout.split_once(TMPFS_LISTING).map(|(a, b)| (a.to_string(), b.to_string())).unwrap_or((run.stdout.clone(), String::new()));
    run.stdout = output;
    (run, listing.lines().map(str::trim).filter(|l| !l.is_empty()).map(|l| l.trim_start_matches("./").to_string()).collect())
}

/// `mpirun ... hpc-train <args>` with a tmpfs of `size` on `dir`; returns the run and what it
/// left in the tmpfs.
pub fn mpirun_with_tmpfs_listing(ranks: usize, args: &[&str], dir: &Path, size: &str, limit: Duration) -> (Run, Vec<String>) {
    let _slot = job_slot();
    with_tmpfs_listing(mpirun_command(ranks, args, &[]), dir, size, limit)
}

/// `hpc-train <args>` alone with a tmpfs of `size` on `dir`; returns the run and what it left
/// in the tmpfs.
pub fn hpc_train_with_tmpfs_listing(args: &[&str], dir: &Path, size: &str) -> (Run, Vec<String>) {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    with_tmpfs_listing(cmd, dir, size, Duration::from_secs(120))
}

pub fn mpirun(ranks: usize, args: &[&str]) -> Run {
    mpirun_env(ranks, args, &[], Duration::from_secs(300))
}

/// Trains with `args` on `ranks` ranks, recording results in `dir`, and returns the path of the
/// final weights it saved (`dir/<name>.safetensors`), for tests that compare weights.
pub fn train_saving_weights(dir: &Path, name: &str, ranks: usize, args: &[&str]) -> PathBuf {
    train_saving_weights_env(dir, name, ranks, args, &[]).0
}

/// [`train_saving_weights`] with environment variables (a fault or a test hook); also gives the
/// run's output.
pub fn train_saving_weights_env(dir: &Path, name: &str, ranks: usize, args: &[&str], env: &[(&str, &str)]) -> (PathBuf, String) {
    let out = dir.join(format!("{name}.safetensors"));
    let mut all = args.to_vec();
    all.extend(["--results", dir.to_str().unwrap(), "--save-weights", out.to_str().unwrap()]);
    let run = mpirun_env(ranks, &all, env, Duration::from_secs(300)).expect_ok();
    (out, run.all_output())
}

/// Many short training runs in one launch (`hpc-train conform`, which runs each on the first
/// ranks of the world in turn): one MPI start-up and libtorch load instead of one per run, for
/// the sweeps that compare many runs' weights (each launch costs a second or more of CI's two
/// cores). A run records into `dir` and saves its weights as [`train_saving_weights`] does.
pub struct Runs {
    dir: PathBuf,
    cases: Vec<(usize, String, Vec<String>)>,
}

impl Runs {
    pub fn new(dir: &Path) -> Runs {
        Runs { dir: dir.to_path_buf(), cases: Vec::new() }
    }

    /// Adds a run of `args` on `ranks` ranks (paths without spaces: the cases file splits on
    /// whitespace); returns where [`Runs::launch`] leaves its weights.
    pub fn add(&mut self, name: &str, ranks: usize, args: &[&str]) -> PathBuf {
        let out = self.dir.join(format!("{name}.safetensors"));
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--results".into(), self.dir.display().to_string(), "--save-weights".into(), out.display().to_string()]);
        assert!(all.iter().all(|a| !a.contains(char::is_whitespace)), "{name}: an option with a space cannot go into a cases file");
        self.cases.push((ranks, name.to_string(), all));
        out
    }

    /// Runs every case added since the last launch, in order, in one launch of as many ranks as
    /// the largest needs; fails naming every case that did not end well. Under MPICH, one
    /// launch per rank count: its idle ranks poll without yielding, and a 1-rank case beside 7
    /// idle ranks took longer than its own launch (tensor parallelism's sweep 32 -> 48 s).
    pub fn launch(&mut self) {
        self.launch_env(&[]);
    }

    /// [`Runs::launch`] with environment variables (a test hook) for every run of the launch.
    pub fn launch_env(&mut self, env: &[(&str, &str)]) {
        let cases = std::mem::take(&mut self.cases);
        if launcher::every_row() {
            self.launch_one(cases, env);
            return;
        }
        let mut counts: Vec<usize> = cases.iter().map(|c| c.0).collect();
        counts.sort_unstable();
        counts.dedup();
        for count in counts {
            self.launch_one(cases.iter().filter(|c| c.0 == count).cloned().collect(), env);
        }
    }

    fn launch_one(&self, cases: Vec<(usize, String, Vec<String>)>, env: &[(&str, &str)]) {
        self.launch_cases(cases, |world, args| mpirun_env(world, args, env, Duration::from_secs(900)));
    }

    /// Runs every case added since the last launch in one launch made by `launch(ranks, args)`
    /// (a launcher of the test's own: tests/cluster.rs's nodes), as [`Runs::launch`] does.
    pub fn launch_through(&mut self, launch: impl FnOnce(usize, &[&str]) -> Run) {
        let cases = std::mem::take(&mut self.cases);
        self.launch_cases(cases, launch);
    }

    fn launch_cases(&self, cases: Vec<(usize, String, Vec<String>)>, launch: impl FnOnce(usize, &[&str]) -> Run) {
        if cases.is_empty() {
            return;
        }
        let file = self.dir.join("cases.txt");
        std::fs::write(&file, cases.iter().map(|(ranks, _, args)| format!("{ranks} {}\n", args.join(" "))).collect::<String>()).unwrap();
        let report = self.dir.join("report.tsv");
        let _ = std::fs::remove_file(&report);
        let world = cases.iter().map(|c| c.0).max().unwrap();
        let run = launch(world, &["conform", "--cases", file.to_str().unwrap(), "--report", report.to_str().unwrap()]);
        assert!(run.ok(), "the launch of {} runs failed ({:?}, timed out: {}):\n{}", cases.len(), run.status, run.timed_out, run.all_output());
        let outcomes = std::fs::read_to_string(&report).unwrap();
        let failed: Vec<String> = outcomes
            .lines()
            .zip(&cases)
            .filter(|(line, _)| line.split('\t').nth(1) != Some("ok"))
            .map(|(line, (_, name, _))| format!("{name}: {line}"))
            .collect();
        assert_eq!(outcomes.lines().count(), cases.len(), "one outcome per run:\n{outcomes}");
        assert!(failed.is_empty(), "runs that did not end well:\n{}", failed.join("\n"));
    }
}

/// A string that lives for the test binary's run: for option lists that mix a test's paths with
/// literals.
pub fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

/// `hpc-train <args>` without mpirun (a singleton MPI process).
pub fn hpc_train(args: &[&str]) -> Run {
    let mut cmd = Command::new(bin());
    cmd.args(args).current_dir(root());
    run_with_limit(cmd, Duration::from_secs(120))
}

/// A small synthetic dataset (written once per test binary and path).
pub fn synth(dir: &Path, name: &str, samples: usize, test: usize, shape: &str, classes: usize) -> PathBuf {
    let out = dir.join(format!("{name}.h5"));
    if !out.exists() {
        hpc_train(&[
            "data", "synth", "--samples", &samples.to_string(), "--test-samples", &test.to_string(),
            "--shape", shape, "--classes", &classes.to_string(), "--out", out.to_str().unwrap(),
        ])
        .expect_ok();
    }
    out
}

/// Reads a safetensors file into (name, values as f64) sorted by name.
pub fn read_weights(path: &Path) -> Vec<(String, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f64>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Largest relative L2 difference between matching tensors of two weight files.
pub fn max_relative_difference(a: &Path, b: &Path) -> f64 {
    let (wa, wb) = (read_weights(a), read_weights(b));
    assert_eq!(wa.len(), wb.len(), "same tensors");
    wa.iter()
        .zip(&wb)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            assert_eq!(va.len(), vb.len(), "{na}");
            let diff: f64 = va.iter().zip(vb).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
            let norm: f64 = va.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
            diff / norm
        })
        .fold(0.0, f64::max)
}

/// The JSON records in a runs.jsonl file.
pub fn read_runs(results: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(results.join("runs.jsonl")).unwrap();
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The Fashion-MNIST file that scripts/setup.sh makes.
pub fn fashion_mnist() -> PathBuf {
    let p = root().join("datasets/fashion-mnist.h5");
    assert!(p.exists(), "{} is missing: run scripts/setup.sh --no-run first", p.display());
    p
}

/// Starts `mpirun -n <ranks> hpc-train <args>` without waiting (for tests that signal or kill
/// ranks); stdout and stderr go to `log`.
pub fn spawn_mpirun(ranks: usize, args: &[&str], env: &[(&str, &str)], log: &Path) -> std::process::Child {
    let out = std::fs::File::create(log).unwrap();
    let err = out.try_clone().unwrap();
    spawn(mpirun_command(ranks, args, env).stdout(out).stderr(err))
}

/// Starts `hpc-train <args>` alone (no launcher) without waiting, stdout and stderr to `log`.
pub fn spawn_hpc_train(args: &[&str], log: &Path) -> std::process::Child {
    let out = std::fs::File::create(log).unwrap();
    let err = out.try_clone().unwrap();
    spawn(Command::new(bin()).args(args).current_dir(root()).stdout(out).stderr(err))
}

/// The rank processes the launcher started, in pid order: its children (Open MPI's mpirun), or
/// the children of its proxies (Hydra's `hydra_pmi_proxy`, one per node).
pub fn rank_pids(mpirun_pid: u32) -> Vec<u32> {
    let children = |pid: u32| -> Vec<u32> {
        let out = Command::new("pgrep").args(["-P", &pid.to_string()]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect()
    };
    let mut pids = Vec::new();
    let mut next = children(mpirun_pid);
    while let Some(pid) = next.pop() {
        match std::fs::read_to_string(format!("/proc/{pid}/comm")) {
            Ok(comm) if comm.trim() == "hydra_pmi_proxy" => next.extend(children(pid)),
            _ => pids.push(pid),
        }
    }
    pids.sort();
    pids
}

/// Sends `signal` (as `kill -<signal>`) to a process.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Waits for a child with a limit; returns its exit code (None when killed by a signal) and
/// how long it took, or None when it outlived the limit (it is then killed).
pub fn wait_limited(child: &mut std::process::Child, limit: Duration) -> Option<(Option<i32>, Duration)> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some((status.code(), start.elapsed()));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Steps of the complete checkpoints in a folder.
pub fn checkpoint_steps(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("ckpt-")).and_then(|s| s.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

/// Waits until `cond` holds (polling), panicking after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A copy of folder `from` at `to` (`cp -a`).
pub fn copy_dir(from: &Path, to: &Path) {
    let status = Command::new("cp").arg("-a").arg(from).arg(to).status().unwrap();
    assert!(status.success());
}

/// Submits a Slurm batch job and waits for its end, as `sbatch --wait` does but polling
/// `scontrol show job` every 0.2 s: `sbatch --wait` polls at growing intervals of up to 10 s
/// (Slurm's sbatch.c), which left these tests 10-30 s behind each short job. `sbatch` comes
/// with `--parsable`; `configure` adds the options, the job file and the environment, which
/// must hold `SLURM_CONF` (scontrol reads it too). Like sbatch's: status 0 when the job
/// COMPLETED, else 1 with its state and exit code in stderr; a job past `limit` is cancelled
/// and the Run says it timed out.
pub fn sbatch_and_wait(configure: impl FnOnce(&mut Command), limit: Duration) -> Run {
    let start = Instant::now();
    let mut sbatch = Command::new("sbatch");
    sbatch.arg("--parsable");
    configure(&mut sbatch);
    let submitted = run_once(&mut sbatch, Duration::from_secs(60));
    if !submitted.ok() {
        return submitted;
    }
    // --parsable prints "ID" or "ID;cluster".
    let id = submitted.stdout.trim().split(';').next().unwrap_or("").to_string();
    assert!(id.parse::<u64>().is_ok(), "sbatch --parsable printed {:?}", submitted.stdout);
    let conf = sbatch.get_envs().find(|(k, _)| *k == "SLURM_CONF").and_then(|(_, v)| v.map(|v| v.to_os_string()));
    // scontrol and scancel, with the job's SLURM_CONF.
    let slurm = |tool: &str, args: &[&str]| {
        let mut cmd = Command::new(tool);
        cmd.args(args);
        if let Some(conf) = &conf {
            cmd.env("SLURM_CONF", conf);
        }
        run_once(&mut cmd, Duration::from_secs(30))
    };
    // Terminal states (squeue(1), JOB STATE CODES); every other state means not yet.
    const ENDED: [&str; 10] = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED"];
    loop {
        let shown = slurm("scontrol", &["show", "job", "--oneliner", &id]);
        let field = |name: &str| shown.stdout.split_whitespace().find_map(|w| w.strip_prefix(name)).unwrap_or("").to_string();
        let state = field("JobState=");
        if ENDED.contains(&state.as_str()) {
            let completed = state == "COMPLETED" && field("ExitCode=") == "0:0";
            let stderr = if completed { submitted.stderr } else { format!("{}job {id} ended {state} (ExitCode={})\n", submitted.stderr, field("ExitCode=")) };
            return Run { status: Some(if completed { 0 } else { 1 }), stdout: submitted.stdout, stderr, elapsed: start.elapsed(), timed_out: false };
        }
        if start.elapsed() > limit {
            slurm("scancel", &[&id]);
            return Run { status: None, stdout: submitted.stdout, stderr: format!("{}job {id} still {state} after {limit:?}: cancelled\n{}", submitted.stderr, shown.stdout), elapsed: start.elapsed(), timed_out: true };
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
