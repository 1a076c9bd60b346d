# Sourced by scripts that need cargo's test binaries by path (pack.sh, test.sh).

# test_executables CARGO-TEST-ARGS...: builds the test binaries cargo test would (--no-run) and
# prints each one's path, as cargo names them (with a hash) in its JSON messages.
test_executables() {
    cargo test --release --locked --no-run --message-format=json "$@" 2>/dev/null | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])'
}

# seed_target_folder FROM TO: starts an empty target folder TO (another MPI's, target/mpich) from
# FROM's release build, so that cargo compiles again only what the MPI library changes: mpi-sys
# and hpc-train, whose build scripts read the MPI (and record it: build.rs refuses a folder built
# against another), and mpi above mpi-sys. Every other crate, libtorch's C++ wrapper in torch-sys
# among them, is the same for either MPI: about 3.5 of a first MPICH build's 5 minutes on 2 cores.
# Cargo fingerprints what it copied as it would its own (a crate whose sources, flags or compiler
# changed since is rebuilt), and the build scripts' outputs name FROM's OUT_DIRs, which cargo
# rewrites to TO's. Does nothing where TO has a release build already or FROM has none.
seed_target_folder() {
    local from=$1/release to=$2/release
    [ -d "$from/.fingerprint" ] && [ ! -e "$to" ] || return 0
    mkdir -p "$2"
    rm -rf "$to.partial"  # a copy an interrupted set-up left
    cp -a "$from" "$to.partial"
    # Copies, not links: cargo rewrites the rebuilt crates' files in place.
    rm -rf "$to.partial"/.fingerprint/{mpi,mpi-sys,hpc-train}-* "$to.partial"/build/{mpi-sys,hpc-train}-* \
        "$to.partial"/hpc-train "$to.partial"/hpc-train.d
    mv "$to.partial" "$to"
}
