#!/usr/bin/env bash
# install-deps.sh installs the Debian packages latentmesh's builds and tests
# need, and nothing else. It is idempotent: packages already installed are left
# alone, and apt-get update runs once, only when something must be installed.
#
#   libibverbs-dev     infiniband/verbs.h and libibverbs.so, for `go build -tags rdma`
#   ibverbs-providers  the userspace device drivers (mlx5, rxe soft-RoCE, ...) that
#                      libibverbs loads at run time; without them no device is listed
#   iproute2           ip netns / ip link, for the network-namespace testbed
#   iptables           partition and blackhole faults in the network-namespace testbed
#   etcd-server        an external etcd (Debian's 3.4) started with default flags, for
#                      tests that must hold under etcd's default request limit and quota
#   python3-numpy      the Python engine SDK (sdk/python) views arena tensors as numpy
#   python3-msgpack    arrays and speaks the msgpack worker protocol; the engine tests
#                      run its reference workers with Debian's /usr/bin/python3
#   python3-torch      the PyTorch reference worker (a small real latent-diffusion
#                      pipeline on CPU); its tests skip, saying why, without it
#   python3-pip        `pip install sdk/python` of the SDK itself, and venv for
#   python3-venv       installing it in isolation
#   prometheus         promtool: `check metrics` on a live agent's /metrics and
#                      `check rules` on docs/alerts.yml (agent/httpapi tests)
#   chromium           headless browser the status page's end-to-end test drives
#                      (testbed TestStatusPageInBrowser, through chromedp)
#   ffmpeg             H.264 MP4s for /v1/videos (ffmpeg), and ffprobe, which the
#                      videoenc and testbed tests check the MP4s with
#   nodejs, npm        the official OpenAI Node client (testbed/testdata/openai-node)
#                      against a mesh; npm only where no npm is on PATH (NodeSource's
#                      nodejs bundles it and conflicts with Debian's npm package)
#   systemd            systemd-analyze verify and security on the units in scripts/,
#                      and systemd-sysusers on latentmesh.sysusers (cmd/latentmesh tests)
#
# Run as root (CI does). Exits non-zero with a message when anything fails.
set -euo pipefail

PACKAGES=(libibverbs-dev ibverbs-providers iproute2 iptables etcd-server
	python3-numpy python3-msgpack python3-torch python3-pip python3-venv
	prometheus chromium ffmpeg nodejs systemd)
command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)

log() { printf 'install-deps: %s\n' "$*"; }
die() { printf 'install-deps: error: %s\n' "$*" >&2; exit 1; }

# installed reports whether dpkg has the package fully installed (a package
# removed with its config files left is known to dpkg but not installed). It
# asks dpkg-query for the status alone rather than piping `dpkg -s` into
# `grep -q`: grep exits at the Status line, dpkg then dies of SIGPIPE writing
# the rest (prometheus's entry is 6 KB), and under pipefail an installed package
# read as missing in 7 of 50 tries.
installed() {
	[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]
}

command -v dpkg >/dev/null 2>&1 || die "dpkg not found: this script supports Debian and derivatives only"

missing=()
for p in "${PACKAGES[@]}"; do
	if installed "$p"; then
		log "$p already installed"
	else
		missing+=("$p")
	fi
done

if [ "${#missing[@]}" -eq 0 ]; then
	log "all dependencies present, nothing to do"
	exit 0
fi

[ "$(id -u)" -eq 0 ] || die "must run as root to install: ${missing[*]}"
command -v apt-get >/dev/null 2>&1 || die "apt-get not found, cannot install: ${missing[*]}"

export DEBIAN_FRONTEND=noninteractive
log "installing: ${missing[*]}"
apt-get -qq update || die "apt-get update failed"
apt-get -qq -y --no-install-recommends \
	-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
	install "${missing[@]}" >/dev/null || die "apt-get install failed for: ${missing[*]}"

for p in "${missing[@]}"; do
	installed "$p" || die "$p still not installed after apt-get install"
done
log "installed: ${missing[*]}"
