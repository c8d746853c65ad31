#!/usr/bin/env bash
# test.sh runs latentmesh's whole test suite: the one command CI runs
# (.ci/run) and the README tells newcomers to run. It needs Go and, for the
# rdma build tag, libibverbs-dev, which scripts/install-deps.sh installs.
#
#   FUZZTIME   how much each fuzz target runs beyond its seed corpus: a count of
#              inputs (default 10000x, a few seconds each) or a duration; 0 skips.
#              A count, because a duration races Go 1.26's fuzz coordinator
#              (go.dev/issue/75804): at the deadline it can report "context
#              deadline exceeded" and fail with no failing input at all.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10000x}

# step prints a heading with the seconds since the run began, so a slow CI run
# shows which step grew.
start=$SECONDS
step() { printf '\n==> [%ds] %s\n' "$((SECONDS - start))" "$*"; }

step "system packages"
if [ "$(id -u)" -eq 0 ]; then
	scripts/install-deps.sh
elif ! dpkg -s libibverbs-dev >/dev/null 2>&1; then
	echo "test.sh: not root and libibverbs-dev missing: run 'sudo scripts/install-deps.sh' first" >&2
	exit 1
fi

step "gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt would change:" >&2
	echo "$unformatted" >&2
	exit 1
fi

step "go vet (default and rdma build tags)"
go vet ./...
# Only transfer/rdma has files behind the tag; the packages above it vet the
# same source either way.
go vet -tags rdma ./transfer/...

step "go build -tags rdma"
go build -tags rdma ./...

step "python engine SDK (sdk/python/tests, Debian's /usr/bin/python3)"
/usr/bin/python3 -m unittest discover -s sdk/python/tests

step "go test -race (no cached results; testbed beside everything after it)"
# testbed, the longest package, takes 10-13 minutes on 2 cores and waits
# more than it computes (idle windows, etcd outages, fault schedules): it
# runs in the background from here to the end, beside the other packages,
# the rdma-tagged tests and the fuzzing, rather than after them (a cold
# run took 25m14s with it after the other packages, 24m05s beside them).
# The timeout leaves it room on a loaded machine.
# Its output goes to a file and is shown at the end, its failures first:
# what CI keeps of a run is its beginning and its end, and a testbed
# failure printed in the middle of the other packages' output was lost.
testbed_log=$(mktemp -t latentmesh-testbed.XXXXXX)
go test -race -count=1 -timeout 20m ./testbed >"$testbed_log" 2>&1 &
testbed=$!
fail() { kill "$testbed" 2>/dev/null || true; exit 1; }
go test -race -count=1 -timeout 20m $(go list ./... | grep -v '/testbed$') || fail

step "go test -race -tags rdma (transfer)"
go test -race -count=1 -tags rdma ./transfer/... || fail

if [ "$FUZZTIME" != "0" ]; then
	# One fuzz worker and one build job at the lowest CPU priority, so
	# testbed's timing-sensitive tests keep their cores: the fuzzing takes
	# the time testbed spends waiting.
	step "fuzz every decoder for $FUZZTIME (one worker, niced, beside testbed)"
	for pkg in $(go list ./...); do
		dir=$(go list -f '{{.Dir}}' "$pkg")
		for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //'); do
			echo "fuzz $pkg $target"
			if ! out=$(nice -n 19 go test -p 1 -parallel 1 -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg" 2>&1); then
				echo "$out" >&2
				fail
			fi
		done
	done
fi

step "waiting for testbed's race tests"
if ! wait "$testbed"; then
	echo "testbed failed. Its failures (a panic's first frames included):"
	grep -n -E -A 25 '^(--- FAIL|panic:|fatal error:|FAIL|.*test timed out)' "$testbed_log" | head -300 || true
	echo "... and the last lines of its output:"
	tail -n 80 "$testbed_log"
	exit 1
fi
tail -n 3 "$testbed_log"
rm -f "$testbed_log"

step "all tests passed"
