#!/usr/bin/env bash
# Where the test suite's time goes: the README's test command on a checkout with cold caches, measured per test
# and per file: wall and busy CPU seconds, Python processes started, Inductor's C++ compiles, torch.compile time.
#
#   bash scripts/benchmarks/profile_suite.sh OUT_DIR [CHECKOUT]   # CHECKOUT: default this one; a quiet machine
#   .venv/bin/python scripts/benchmarks/profile_suite_report.py OUT_DIR
#
# CHECKOUT is set up first if it has no .venv (scripts/setup.sh, not timed), so a fresh clone of any commit can be
# profiled with this script: git clone /work/main /tmp/old && git -C /tmp/old checkout 2190de7.
# Cold caches as CI on a new machine: an empty TORCHINDUCTOR_CACHE_DIR and XDG_CACHE_HOME. The probes:
# * the C++ compiler is reached through CXX (Inductor reads it), a wrapper that appends "start end test" to
#   OUT_DIR/gxx.log (a few milliseconds per compile);
# * suite_probe/sitecustomize.py on PYTHONPATH logs every Python process started (launches.log) and every
#   torch.compile of a frame or a lazy backward (compiles.log), each tagged with the running test;
# * suite_probe/suite_probe_plugin.py (pytest -p) logs each test's wall and the machine's busy CPU-seconds
#   (tests.log; /proc/stat, so a quiet machine matters).
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=$(realpath -m "${1:-outputs/profile_suite}")
checkout=$(realpath "${2:-$here/../..}")
rm -rf "$out"; mkdir -p "$out/inductor" "$out/xdg" "$out/probe"
cp "$here/suite_probe/sitecustomize.py" "$here/suite_probe/suite_probe_plugin.py" "$out/probe/"
cd "$checkout"
[ -x .venv/bin/python ] || bash scripts/setup.sh > "$out/setup.log" 2>&1
git log -1 --format='%h %s' > "$out/commit.txt" 2>/dev/null
cat > "$out/g++" <<'WRAP'
#!/usr/bin/env bash
start=$(date +%s.%N)
g++ "$@"
rc=$?
echo "$start $(date +%s.%N) ${PYTEST_CURRENT_TEST:-none}" >> "$GXX_LOG"
exit $rc
WRAP
chmod +x "$out/g++"
uptime > "$out/load.start"
head -1 /proc/stat > "$out/procstat.start"
start=$(date +%s)
CXX="$out/g++" GXX_LOG="$out/gxx.log" TORCHINDUCTOR_CACHE_DIR="$out/inductor" XDG_CACHE_HOME="$out/xdg" \
  TITAN_SUITE_PROBE="$out" PYTHONPATH="$out/probe${PYTHONPATH:+:$PYTHONPATH}" \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider -p suite_probe_plugin \
  --durations=30 --junitxml="$out/suite.xml" > "$out/suite.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - start ))" >> "$out/suite.log"
head -1 /proc/stat > "$out/procstat.end"
tail -2 "$out/suite.log"
