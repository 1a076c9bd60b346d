//! scripts/setup.sh as a new cluster user runs it: a non-root account without sudo, MPI and HDF5
//! only from Lmod modules off the default paths (the system's own hidden in a private mount
//! namespace), by scripts/lib/install-test.sh. Needs root to make the namespace; CI runs as root.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// The scratch folder and everything the script started in it; removed when dropped, even when
/// an assertion failed.
struct InstallScratch(PathBuf);

impl Drop for InstallScratch {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/lib/install-test.sh")).arg("cleanup").arg(&self.0).status();
    }
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
}

#[test]
fn setup_as_a_user_without_root_finds_mpi_and_hdf5_in_modules() {
    if covered_by_the_first_mpi("set-up as a user without root (it builds against its own module's MPI)") {
        return;
    }
    let uid = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    if uid != "0" {
        eprintln!("skipped: the install test needs root, to make a mount namespace and switch to a test account");
        return;
    }
    let libtorch = std::env::var("LIBTORCH").expect("LIBTORCH (scripts/env.sh sets it)");
    let scratch = InstallScratch(PathBuf::from(format!("/tmp/hpc-train-install-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&scratch.0);
    let mut cmd = Command::new(root().join("scripts/lib/install-test.sh"));
    cmd.arg("run").arg(&scratch.0).env("ROOT", root()).env("LIBTORCH", &libtorch);
    let run = run_with_limit(cmd, Duration::from_secs(1500));
    if run.status == Some(77) {
        eprintln!("{}", run.stderr.trim());
        return;
    }
    assert!(run.ok(), "install-test.sh failed ({:?}):\n{}", run.status, run.all_output());
    let out = scratch.0.join("out");
    let log = |name: &str| format!("{} (exit {}, {} s):\n{}", name, read(&out, &format!("{name}.rc")).trim(), read(&out, &format!("{name}.seconds")).trim(), read(&out, &format!("{name}.log")));

    // The namespace hid the system's MPI, HDF5 and dataset: the user finds them only in modules.
    assert_eq!(read(&out, "hidden-check").trim(), "", "the system's MPI or HDF5 is visible in the namespace");

    // Without the modules: --check names each missing part with its packages and module, exit 1.
    let check = log("check");
    assert_eq!(read(&out, "check.rc").trim(), "1", "{check}");
    for line in [
        "MISSING  MPI compiler wrapper",
        "Debian: openmpi-bin libopenmpi-dev; RHEL: openmpi-devel; module: openmpi",
        "MISSING  HDF5",
        "Debian: libhdf5-dev; RHEL: hdf5-devel; module: hdf5",
        "present  libclang",
        "present  Rust >= 1.89",
        "not root: nothing is installed system-wide",
    ] {
        assert!(check.contains(line), "--check without modules lacks {line:?}:\n{check}");
    }
    let modules = scratch.0.join("modules");
    let with_modules = log("check-modules");
    assert_eq!(read(&out, "check-modules.rc").trim(), "0", "{with_modules}");
    assert!(with_modules.contains(&format!("present  MPI compiler wrapper         {}", modules.join("sw/openmpi").display())), "{with_modules}");

    // With them: libtorch from LIBTORCH, the build, the dataset from the mirror, the short job.
    let setup = log("setup");
    assert_eq!(read(&out, "setup.rc").trim(), "0", "{setup}");
    for line in [&format!(" present in {libtorch}") as &str, "downloading Fashion-MNIST", "training: 2 ranks"] {
        assert!(setup.contains(line), "set-up's log lacks {line:?}:\n{setup}");
    }
    assert!(setup.contains("MPI: Open MPI 4.1.4") && setup.contains(&modules.display().to_string()), "not built against the module's MPI:\n{setup}");
    let again = log("again");
    assert_eq!(read(&out, "again.rc").trim(), "0", "{again}");
    assert!(again.contains("datasets/fashion-mnist.h5 present"), "{again}");

    // The binary loads the module's libmpi and libhdf5 and no library goes missing.
    let ldd = read(&out, "ldd.log");
    let resolved = |lib: &str| ldd.lines().find(|l| l.trim_start().starts_with(lib)).unwrap_or_else(|| panic!("ldd shows no {lib}:\n{ldd}")).to_string();
    assert!(resolved("libmpi.so.40").contains(&modules.join("sw/openmpi/4.1.4").display().to_string()), "{ldd}");
    assert!(resolved("libhdf5_serial.so.103").contains(&modules.join("sw/hdf5/1.10.8").display().to_string()), "{ldd}");
    assert!(resolved("libtorch_cpu.so").contains(&libtorch), "{ldd}");
    assert!(!ldd.contains("not found"), "{ldd}");

    // Nothing system-wide: no sudo or apt call, the system's files unchanged, no stray files.
    assert_eq!(read(&out, "system-calls").trim(), "", "set-up called a system tool");
    assert_eq!(read(&out, "system-before"), read(&out, "system-after"), "/etc/passwd, /etc/group or dpkg's status changed");
    assert_eq!(read(&out, "stray-files").trim(), "", "the account left files outside its home");
    eprintln!("set-up as a user without root: --check {} s, set-up {} s, second run {} s", read(&out, "check.seconds").trim(), read(&out, "setup.seconds").trim(), read(&out, "again.seconds").trim());
    // What results/cluster-path/install.md records of the run.
    for lib in ["libmpi.so.40", "libhdf5_serial.so.103", "libtorch_cpu.so"] {
        eprintln!("  ldd: {}", resolved(lib).trim());
    }
    for line in setup.lines().filter(|l| l.starts_with("==>") || l.contains("images/s") || l.contains("test accuracy")) {
        eprintln!("  set-up: {}", line.trim());
    }
}
