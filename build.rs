//! Build script: gives the binary a run path to libtorch, so that it starts without LD_LIBRARY_PATH,
//! compiles the small C shim that reads constants from mpi.h, and records which MPI library that
//! mpi.h belongs to.
//!
//! torch-sys (declared `links = "tch"`) exports the libtorch folder it linked against as
//! `DEP_TCH_LIBTORCH_LIB`. That folder comes first; then folders relative to the binary, used by the
//! bundle that `scripts/pack.sh` makes for machines without Rust; then those `HPC_TRAIN_EXTRA_RPATH`
//! names (pack.sh names the torch of the GPU test machines there). No other machine's path is
//! compiled in: a binary built elsewhere finds libtorch where set-up put it, or where `LIBTORCH`
//! pointed at build time.

use std::env;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_mpi_shim();
    build_torch_shims();
    record_git_commit();
    println!("cargo:rerun-if-env-changed=HPC_TRAIN_EXTRA_RPATH");

    let mut run_paths: Vec<String> = Vec::new();
    if let Ok(lib) = env::var("DEP_TCH_LIBTORCH_LIB") {
        run_paths.push(lib);
    }
    run_paths.push("$ORIGIN/lib".into());
    run_paths.push("$ORIGIN/../lib".into());
    if let Ok(extra) = env::var("HPC_TRAIN_EXTRA_RPATH") {
        run_paths.extend(extra.split(':').filter(|p| !p.is_empty()).map(String::from));
    }
    for path in &run_paths {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{path}");
    }
}

/// Compiles the few lines of C that read constants from mpi.h (src/shim/mpi_shim.c), and records
/// which MPI library that mpi.h belongs to, for `hpc-train --version`, the check at start that the
/// library and launcher are the ones built for (src/mpi_library.rs), and the tests' choice of
/// launcher (`HPC_TRAIN_MPI_FAMILY`).
///
/// The mpi crate's build script (mpi-sys) finds MPI as this one does (build-probe-mpi:
/// `MPI_PKG_CONFIG`, `CRAY_MPICH_DIR`, `$MPICC -show` or `mpicc -show`, pkg-config `mpich`, then
/// `ompi`) but never runs again when those change, so a target folder stays bound to the MPI of
/// its first build. This script runs again when they change and refuses to go on with another
/// library than the first: its shim and the bindings would then come from two MPIs.
fn build_mpi_shim() {
    println!("cargo:rerun-if-changed=src/shim/mpi_shim.c");
    println!("cargo:rerun-if-changed=src/shim/mpi_identity.c");
    for var in ["MPICC", "MPI_PKG_CONFIG", "CRAY_MPICH_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let mpi = build_probe_mpi::probe().unwrap_or_else(|errors| {
        panic!("could not find an MPI library (install libopenmpi-dev or libmpich-dev, or set MPICC or MPI_PKG_CONFIG): {errors:?}")
    });
    let mut build = cc::Build::new();
    // As mpi-sys does: the MPI compiler wrapper where there is one, so that the same mpi.h is read.
    if let Some(mpicc) = &mpi.mpicc {
        build.compiler(mpicc);
    }
    for include in &mpi.include_paths {
        build.include(include);
    }
    let identity = MpiIdentity::of(&build, &mpi);
    keep_the_first_mpi(&identity);
    println!("cargo:rustc-env=HPC_TRAIN_MPI_FAMILY={}", identity.family);
    println!("cargo:rustc-env=HPC_TRAIN_MPI_BUILT={}", identity.describe());
    build.file("src/shim/mpi_shim.c");
    build.compile("hpc_train_mpi_shim");
}

/// The MPI library an mpi.h belongs to, read by the preprocessor (src/shim/mpi_identity.c).
struct MpiIdentity {
    /// `openmpi`, `mpich` (MPICH and the libraries sharing its ABI) or `unknown`.
    family: String,
    /// The library and its version, e.g. "MPICH 4.0.2".
    library: String,
    /// The MPI standard's version the header declares, e.g. "4.0".
    standard: String,
    /// How it was found, e.g. "mpicc.mpich -show".
    found_by: String,
    /// The folder of mpi.h, where known.
    include: Option<String>,
}

impl MpiIdentity {
    fn of(build: &cc::Build, mpi: &build_probe_mpi::Library) -> MpiIdentity {
        let mut expand = build.clone();
        expand.file("src/shim/mpi_identity.c").cargo_warnings(false);
        let text = String::from_utf8_lossy(&expand.expand()).into_owned();
        let line = |marker: &str| -> Vec<String> {
            text.lines()
                .map(str::trim)
                .find_map(|l| l.strip_prefix(marker).filter(|rest| rest.starts_with(char::is_whitespace)))
                .map(tokens)
                .unwrap_or_default()
        };
        let identity = line("hpc_train_mpi_identity");
        let (family, name, version) = match identity.as_slice() {
            [family, name, version @ ..] => (family.clone(), name.clone(), version.join(".")),
            _ => ("unknown".to_string(), "an MPI library".to_string(), String::new()),
        };
        let found_by = match (&mpi.mpicc, env::var("MPI_PKG_CONFIG"), env::var("CRAY_MPICH_DIR")) {
            (Some(mpicc), _, _) => format!("{mpicc} -show"),
            (None, Ok(module), _) => format!("pkg-config {module} (MPI_PKG_CONFIG)"),
            (None, Err(_), Ok(dir)) => format!("CRAY_MPICH_DIR={dir}"),
            _ => "pkg-config".to_string(),
        };
        MpiIdentity {
            family,
            library: if version.is_empty() { name } else { format!("{name} {version}") },
            standard: line("hpc_train_mpi_standard").join("."),
            found_by,
            include: mpi.include_paths.first().map(|p| p.display().to_string()),
        }
    }

    /// One line for `hpc-train --version`.
    fn describe(&self) -> String {
        let include = self.include.as_ref().map(|i| format!(", mpi.h in {i}")).unwrap_or_default();
        format!("{} (MPI {}; {} family; found by {}{include})", self.library, self.standard, self.family, self.found_by)
    }
}

/// Preprocessor tokens of a line: quoted strings without their quotes, other tokens as they are.
fn tokens(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line.trim();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').unwrap_or(quoted.len());
            out.push(quoted[..end].to_string());
            rest = quoted.get(end + 1..).unwrap_or("").trim_start();
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            out.push(rest[..end].to_string());
            rest = rest[end..].trim_start();
        }
    }
    out
}

/// Stops the build when this target folder was first built against another MPI library (see
/// `build_mpi_shim`); remembers the first one in OUT_DIR, which cargo keeps between runs.
fn keep_the_first_mpi(identity: &MpiIdentity) {
    let record = std::path::PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("mpi-library");
    let now = format!("{} ({} family)", identity.library, identity.family);
    match std::fs::read_to_string(&record) {
        Ok(first) if first.trim() != now => panic!(
            "this target folder was built against {}, and the mpi crate's bindings (mpi-sys) stay bound to it: they are \
             not rebuilt when MPICC, MPI_PKG_CONFIG or CRAY_MPICH_DIR change, and these now find {now}. Build each MPI \
             library into its own target folder (HPC_TRAIN_MPI=mpich scripts/setup.sh, or by hand: MPICC=mpicc.mpich \
             CARGO_TARGET_DIR=target/mpich cargo build --release), or `cargo clean` this one first",
            first.trim()
        ),
        Ok(_) => {}
        Err(_) => std::fs::write(&record, &now).expect("writing to OUT_DIR"),
    }
}

/// The commit the binary is built from, for runs.jsonl (`unknown` outside a git checkout).
fn record_git_commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            // `git status` may rewrite the index to refresh its stat data, and the index is
            // watched below: a build would then make the next cargo call rebuild the crate.
            .env("GIT_OPTIONAL_LOCKS", "0")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // Dirty means the code differs from the commit: what goes into the binary, not results/
    // files that a measurement script has just rewritten before building.
    let code = ["src", "build.rs", "Cargo.toml", "Cargo.lock"];
    let dirty = git(&[&["status", "--porcelain", "--untracked-files=no", "--"][..], &code[..]].concat()).is_some_and(|s| !s.is_empty());
    let value = if dirty { format!("{commit}-dirty") } else { commit };
    println!("cargo:rustc-env=HPC_TRAIN_GIT_COMMIT={value}");
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        // HEAD names a branch whose own file (or packed-refs) is what a commit changes. Only
        // files that exist: cargo counts a missing one as changed on every build, and reran
        // this script and recompiled the crate at every cargo call in a checkout without
        // packed-refs (a minute or two of CI's each time). A file that appears later (git gc
        // packing the branch's ref) changes one that is watched (the branch's own file goes).
        let branch = git(&["symbolic-ref", "-q", "HEAD"]);
        let watched = ["HEAD", "index", "packed-refs"].into_iter().map(String::from).chain(branch);
        for file in watched.map(|f| format!("{dir}/{f}")).filter(|f| std::path::Path::new(f).exists()) {
            println!("cargo:rerun-if-changed={file}");
        }
    }
}

/// Compiles the C++ shims (src/shim: gradient-ready hooks and other libtorch calls, regions,
/// the profiler) against the headers of the libtorch that torch-sys linked, with the same C++ ABI.
fn build_torch_shims() {
    println!("cargo:rerun-if-changed=src/shim/grad_hooks.cpp");
    println!("cargo:rerun-if-changed=src/shim/regions.cpp");
    println!("cargo:rerun-if-changed=src/shim/profiler.cpp");
    println!("cargo:rerun-if-changed=src/shim/split_backward.cpp");
    println!("cargo:rerun-if-changed=src/shim/write_error.h");
    println!("cargo:rerun-if-env-changed=HPC_TRAIN_CXX11_ABI");
    let lib = std::path::PathBuf::from(env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys exports its libtorch folder"));
    let root = lib.parent().expect("libtorch/lib has a parent").to_path_buf();
    let abi = env::var("HPC_TRAIN_CXX11_ABI").unwrap_or_else(|_| cxx11_abi_of(&lib.join("libc10.so")));
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .file("src/shim/grad_hooks.cpp")
        .file("src/shim/regions.cpp")
        .file("src/shim/profiler.cpp")
        .file("src/shim/split_backward.cpp")
        .compile("hpc_train_grad_hooks");
}

/// 1 when libc10 was built with the C++11 string ABI (its symbols name `__cxx11`), else 0.
fn cxx11_abi_of(libc10: &std::path::Path) -> String {
    let out = std::process::Command::new("nm").args(["-D", "--defined-only"]).arg(libc10).output();
    match out {
        Ok(o) if o.status.success() => {
            if String::from_utf8_lossy(&o.stdout).contains("__cxx11") { "1".into() } else { "0".into() }
        }
        // Every libtorch since 2.7 uses the new ABI.
        _ => "1".into(),
    }
}
