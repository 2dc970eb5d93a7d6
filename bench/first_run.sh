#!/usr/bin/env bash
# The first ten minutes of a new user, timed: a fresh clone of this checkout's main and a fresh $HOME, then the
# README's two commands as written (`make demo`, then `make test`), each timed by /usr/bin/time, with the machine's
# load before and after. Prints the folder it worked in; its times.txt holds the figures, demo.log and test.log the
# output.
#
#   bench/first_run.sh [--from-nothing]
#
# --from-nothing also removes what `make test` installs from Debian (chromium, bubblewrap, wordnet-base, then
# autoremove and apt's cache) and torch's compile cache in /tmp, as on a new machine: as root, on a machine of your
# own only. Without it those stay, and the figures are the venv's, the models' and the suite's.
set -uo pipefail
top=$(git -C "$(dirname "$0")" rev-parse --show-toplevel) || exit 2
if [ "${1:-}" = "--from-nothing" ]; then
    apt-get remove -y -qq chromium bubblewrap wordnet-base >/dev/null 2>&1
    apt-get autoremove -y -qq >/dev/null 2>&1
    apt-get clean
    rm -rf /tmp/torchinductor_"$(id -un)"
fi
d=$(mktemp -d /tmp/proxima-first-run-XXXX)
mkdir -p "$d/home"
git clone -q --branch main "$top" "$d/main" || exit 2
[ -d "$top/../shared" ] && cp -r "$top/../shared" "$d/shared"
cd "$d/main" || exit 2
export HOME="$d/home"
echo "$d"
{
    echo "commit $(git log --oneline -1)"
    echo "cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) ($(nproc) cores)"
    echo "load before the demo: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$d/times.txt"
/usr/bin/time -f "make demo: %e s" -a -o "$d/times.txt" make demo > "$d/demo.log" 2>&1
echo "make demo exit $?; load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$d/times.txt"
/usr/bin/time -f "make test: %e s" -a -o "$d/times.txt" make test > "$d/test.log" 2>&1
echo "make test exit $?; load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$d/times.txt"
grep -h "the suite took\|passed\|failed" "$d/test.log" | tail -2 >> "$d/times.txt"
cat "$d/times.txt"
