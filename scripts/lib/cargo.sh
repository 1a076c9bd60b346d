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
