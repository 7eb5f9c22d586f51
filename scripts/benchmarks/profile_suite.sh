#!/usr/bin/env bash
# Where the test suite's time goes: the README's test command with cold caches, plus every C++ compile Inductor
# runs (timed and named by the test that ran it) and the machine's CPU busy time over the run.
#
#   bash scripts/benchmarks/profile_suite.sh [out_dir]        # ~42 min on 2 cores; a quiet machine
#   .venv/bin/python scripts/benchmarks/profile_suite_report.py out_dir
#
# Cold caches as CI on a new machine: an empty TORCHINDUCTOR_CACHE_DIR and XDG_CACHE_HOME. The C++ compiler is
# reached through CXX (Inductor reads it), a wrapper that appends "start end test" to out_dir/gxx.log; its own
# cost is a few milliseconds per compile.
set -u
cd "$(dirname "$0")/../.."
out=$(realpath -m "${1:-outputs/profile_suite}")
rm -rf "$out"; mkdir -p "$out/inductor" "$out/xdg"
cat > "$out/g++" <<'WRAP'
#!/usr/bin/env bash
start=$(date +%s.%N)
g++ "$@"
rc=$?
echo "$start $(date +%s.%N) ${PYTEST_CURRENT_TEST:-none}" >> "$GXX_LOG"
exit $rc
WRAP
chmod +x "$out/g++"
head -1 /proc/stat > "$out/procstat.start"
start=$(date +%s)
CXX="$out/g++" GXX_LOG="$out/gxx.log" TORCHINDUCTOR_CACHE_DIR="$out/inductor" XDG_CACHE_HOME="$out/xdg" \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
  --junitxml="$out/suite.xml" > "$out/suite.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - start ))" >> "$out/suite.log"
head -1 /proc/stat > "$out/procstat.end"
tail -2 "$out/suite.log"
