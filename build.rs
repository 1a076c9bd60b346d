//! Build script: gives the binary a run path to libtorch, so that it starts without LD_LIBRARY_PATH,
//! and compiles the small C shim that reads constants from mpi.h.
//!
//! torch-sys (declared `links = "tch"`) exports the libtorch folder it linked against as
//! `DEP_TCH_LIBTORCH_LIB`. That folder comes first; then folders relative to the binary, used by the
//! bundle that `scripts/pack.sh` makes for machines without Rust; then the usual place of the
//! Python torch on the GPU test machines.

use std::env;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_mpi_shim();
    build_grad_hooks_shim();
    record_git_commit();
    println!("cargo:rerun-if-env-changed=HPC_TRAIN_EXTRA_RPATH");

    let mut run_paths: Vec<String> = Vec::new();
    if let Ok(lib) = env::var("DEP_TCH_LIBTORCH_LIB") {
        run_paths.push(lib);
    }
    run_paths.push("$ORIGIN/lib".into());
    run_paths.push("$ORIGIN/../lib".into());
    run_paths.push("/opt/torch/.venv/lib/python3.12/site-packages/torch/lib".into());
    if let Ok(extra) = env::var("HPC_TRAIN_EXTRA_RPATH") {
        run_paths.extend(extra.split(':').filter(|p| !p.is_empty()).map(String::from));
    }
    for path in &run_paths {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{path}");
    }
}

/// Compiles the few lines of C that read constants from mpi.h (see src/shim/mpi_shim.c).
fn build_mpi_shim() {
    println!("cargo:rerun-if-changed=src/shim/mpi_shim.c");
    let mpi = build_probe_mpi::probe().unwrap_or_else(|errors| {
        panic!("could not find an MPI library (install libopenmpi-dev, or set MPICC): {errors:?}")
    });
    let mut build = cc::Build::new();
    build.file("src/shim/mpi_shim.c");
    for include in &mpi.include_paths {
        build.include(include);
    }
    build.compile("hpc_train_mpi_shim");
}

/// The commit the binary is built from, for runs.jsonl (`unknown` outside a git checkout).
fn record_git_commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
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
        // HEAD names a branch whose own file (or packed-refs) is what a commit changes.
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        println!("cargo:rerun-if-changed={dir}/packed-refs");
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{branch}");
        }
    }
}

/// Compiles the gradient-ready hook shim (src/shim/grad_hooks.cpp) against the headers of the
/// libtorch that torch-sys linked, with the same C++ ABI.
fn build_grad_hooks_shim() {
    println!("cargo:rerun-if-changed=src/shim/grad_hooks.cpp");
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
