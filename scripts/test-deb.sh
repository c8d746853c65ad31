#!/usr/bin/env bash
# test-deb.sh checks the .deb on a clean Debian root, as root:
#   1. builds it (scripts/package-deb.sh; DEB=FILE uses a built one);
#   2. debootstraps a minimal Debian (the host's suite; SUITE= to change),
#      cached as a tarball under $CACHE after the first run, and installs
#      systemd there as a Debian host has it;
#   3. installs the .deb in that root with apt, which brings its Depends,
#      and checks the user, the directories' owners and the conffile;
#   4. runs `systemd-analyze verify` on the installed units in the root;
#   5. starts a mesh on the host (an embedded etcd from `latentmesh-dev dev
#      --agents 0` and an encode+decode agent), runs the installed agent in
#      the root as the latentmesh user with roles denoise (the root shares
#      the host's network), checks that the
#      host's agent lists it, and runs a job whose denoise must run there
#      (its settings are written into the installed agent.yaml, which the
#      agent reads by default, as under the units);
#   6. stops the root's agent with SIGTERM, which must drain and exit 0.
# Prints each step with its time and a summary. Leaves nothing mounted on
# the host: every command in the root runs in its own mount namespace.
# KEEP=1 keeps the work folder (the root and the logs); DEV_BIN=FILE uses a
# built latentmesh-dev.
set -euo pipefail

SUITE=${SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE=${CACHE:-/var/cache/latentmesh/test-deb}
PREFIX=/latentmesh/test-deb

t0=$(date +%s)
log() { printf 'test-deb [%3ds]: %s\n' "$(($(date +%s) - t0))" "$*"; }
die() {
	printf 'test-deb [%3ds]: FAIL: %s\n' "$(($(date +%s) - t0))" "$*" >&2
	exit 1
}

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, chroot)"
[ -n "$SUITE" ] || die "cannot tell the host's Debian suite from /etc/os-release: set SUITE"
for c in python3 curl unshare; do
	command -v "$c" >/dev/null 2>&1 || die "$c not found"
done

root_dir=$(cd "$(dirname "$0")/.." && pwd)
cd "$root_dir"

if ! command -v debootstrap >/dev/null 2>&1; then
	log "installing debootstrap"
	DEBIAN_FRONTEND=noninteractive apt-get -qq -y -o DPkg::Lock::Timeout=600 \
		--no-install-recommends install debootstrap >/dev/null ||
		die "apt-get install debootstrap failed"
fi

work=$(mktemp -d /tmp/latentmesh-test-deb.XXXXXX)
R=$work/root
pids=()
cleanup() {
	local rc=$?
	for p in "${pids[@]}"; do
		kill "$p" 2>/dev/null || true
	done
	for p in "${pids[@]}"; do
		wait "$p" 2>/dev/null || true
	done
	if [ "${KEEP:-}" = 1 ] || [ "$rc" -ne 0 ]; then
		log "kept $work (logs: $work/*.log)"
	elif findmnt -rn -o TARGET | grep "^$R" >/dev/null; then
		log "something is still mounted under $R: not deleting $work"
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT

# in_root CMD... runs CMD in the root with /proc, /dev and /sys mounted in
# a mount namespace of its own, so the mounts go when CMD exits.
# IN_ROOT_EXEC=exec makes the caller's (sub)shell become CMD, so that a
# background in_root's $! is CMD itself.
in_root() {
	${IN_ROOT_EXEC:-} unshare --mount --propagation private -- /bin/sh -c '
		r=$1; shift
		mount -t proc proc "$r/proc" && mount --rbind /dev "$r/dev" &&
			mount --rbind /sys "$r/sys" || exit 125
		exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
			LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"' sh "$R" "$@"
}

# freeport prints a TCP port nothing listens on now.
freeport() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# json FILE EXPR prints a Python expression over the JSON document j.
json() {
	python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$@"
}

# --- 1. the package ----------------------------------------------------
if [ -n "${DEB:-}" ]; then
	deb=$(cd "$(dirname "$DEB")" && pwd)/$(basename "$DEB")
	[ -f "$deb" ] || die "DEB=$DEB: no such file"
	bin=dist/build/latentmesh
	[ -x "$bin" ] || die "DEB= needs the binary package-deb.sh left in $bin"
else
	log "building the .deb"
	deb=$(scripts/package-deb.sh 2>"$work/package.log") ||
		die "package-deb.sh failed: $(tail -20 "$work/package.log")"
	bin=dist/build/latentmesh
fi
log "package: $deb ($(du -h "$deb" | cut -f1))"
dev=${DEV_BIN:-}
if [ -z "$dev" ]; then
	log "building latentmesh-dev for the host's etcd"
	dev=$work/latentmesh-dev
	go build -o "$dev" ./cmd/latentmesh-dev || die "go build ./cmd/latentmesh-dev failed"
fi

# --- 2. a clean Debian root ----------------------------------------------
arch=$(dpkg --print-architecture)
base=$CACHE/$SUITE-$arch-minbase-systemd.tar
if [ ! -f "$base" ]; then
	log "debootstrap $SUITE ($arch) from $MIRROR (first run; cached in $base)"
	mkdir -p "$CACHE/debs" "$work/boot"
	debootstrap --variant=minbase --include=systemd --cache-dir="$CACHE/debs" \
		--arch="$arch" "$SUITE" "$work/boot" "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
		die "debootstrap failed: $(tail -20 "$work/debootstrap.log")"
	tar -C "$work/boot" -cf "$base.tmp" . && mv "$base.tmp" "$base"
	rm -rf "$work/boot"
fi
mkdir "$R"
tar -C "$R" -xf "$base"
cp /etc/resolv.conf "$R/etc/resolv.conf"
# No service starts in a chroot.
printf '#!/bin/sh\nexit 101\n' >"$R/usr/sbin/policy-rc.d"
chmod 755 "$R/usr/sbin/policy-rc.d"
log "root ready: $SUITE, $(in_root dpkg-query -W -f='${Package}\n' | wc -l) packages"

# --- 3. install the .deb with apt -----------------------------------------
cp "$deb" "$R/tmp/"
debname=$(basename "$deb")
in_root apt-get -qq update >"$work/apt.log" 2>&1 || die "apt-get update in the root failed: $(tail "$work/apt.log")"
in_root apt-get -qq -y --no-install-recommends install "/tmp/$debname" >>"$work/apt.log" 2>&1 ||
	die "apt-get install of the .deb failed: $(tail -20 "$work/apt.log")"
status=$(in_root dpkg-query -W -f='${Status} ${Version}' latentmesh)
case "$status" in "install ok installed "*) ;; *) die "dpkg says: $status" ;; esac
log "installed: latentmesh ${status##* } with $(in_root dpkg-query -W -f='${Depends}' latentmesh)"
in_root dpkg-query -W -f='${Status}\n' libibverbs1 | grep "install ok installed" >/dev/null ||
	die "libibverbs1 (Depends) not installed"
in_root getent passwd latentmesh >/dev/null || die "no latentmesh user"
for want in "/etc/latentmesh root:latentmesh 750" "/etc/latentmesh/agent.yaml root:latentmesh 640" \
	"/var/lib/latentmesh latentmesh:latentmesh 700"; do
	set -- $want
	got=$(in_root stat -c '%U:%G %a' "$1")
	[ "$got" = "$2 $3" ] || die "$1 is $got, want $2 $3"
done
in_root dpkg-query -W -f='${Conffiles}\n' latentmesh | grep ' /etc/latentmesh/agent.yaml ' >/dev/null ||
	die "/etc/latentmesh/agent.yaml is not a conffile"
version=$(in_root /usr/bin/latentmesh version) || die "the installed binary does not run"
log "user, directories and conffile as packaged; latentmesh version: $version"

# --- 4. the units -----------------------------------------------------------
units=(latentmesh-agent.service latentmesh-agent@0.service latentmesh-engine@0.service)
paths=()
for u in "${units[@]}"; do
	paths+=("/usr/lib/systemd/system/$u")
done
if ! out=$(in_root systemd-analyze verify "${paths[@]}" 2>&1) || [ -n "$out" ]; then
	die "systemd-analyze verify: $out"
fi
log "systemd-analyze verify: ${units[*]}: no findings"

# --- 5. the installed agent joins a mesh --------------------------------------
etcd_port=$(freeport)
"$dev" dev --agents 0 --etcd-listen "127.0.0.1:$etcd_port" --prefix "$PREFIX" \
	>"$work/etcd.log" 2>&1 &
pids+=($!)
endpoint=http://127.0.0.1:$etcd_port
host_http=$(freeport) host_admin=$(freeport)
wait_for() { # wait_for SECONDS WHAT CMD...: retry CMD every 0.2 s within SECONDS
	local until=$(($(date +%s) + $1)) what=$2
	shift 2
	until "$@" >/dev/null 2>&1; do
		[ "$(date +%s)" -lt "$until" ] || die "timed out waiting for $what"
		sleep 0.2
	done
}
wait_for 30 "the embedded etcd" curl -sf "$endpoint/health"
"$bin" agent --etcd-endpoints "$endpoint" --prefix "$PREFIX" --node-id host-agent \
	--roles encode,decode --http "127.0.0.1:$host_http" --admin "127.0.0.1:$host_admin" \
	--state-dir "$work/host-state" >"$work/host-agent.log" 2>&1 &
pids+=($!)
wait_for 60 "the host's agent" curl -sf "http://127.0.0.1:$host_admin/readyz"
log "host mesh: etcd $endpoint, agent host-agent (encode,decode)"

root_http=$(freeport) root_admin=$(freeport)
# As an operator would: the settings in the installed conffile, and the
# agent started as the units start it, with no flags (it reads
# /etc/latentmesh/agent.yaml by default) and $STATE_DIRECTORY.
cat >>"$R/etc/latentmesh/agent.yaml" <<EOF
etcd-endpoints: [$endpoint]
prefix: $PREFIX
node-id: deb-agent
roles: [denoise]
http: 127.0.0.1:$root_http
admin: 127.0.0.1:$root_admin
EOF
IN_ROOT_EXEC=exec in_root setpriv --reuid=latentmesh --regid=latentmesh --init-groups \
	/usr/bin/env HOME=/var/lib/latentmesh STATE_DIRECTORY=/var/lib/latentmesh \
	/usr/bin/latentmesh agent >"$work/deb-agent.log" 2>&1 &
deb_pid=$!
pids+=("$deb_pid")
wait_for 60 "the installed agent to be ready" curl -sf "http://127.0.0.1:$root_admin/readyz"
joined() {
	curl -sf "http://127.0.0.1:$host_admin/v1/admin/status" >"$work/status.json" &&
		[ "$(json "$work/status.json" '[p["alive"] for p in j["peers"] if p["id"] == "deb-agent"] == [True]')" = True ]
}
wait_for 30 "host-agent to list deb-agent alive" joined
log "host-agent lists deb-agent: $(json "$work/status.json" '", ".join(p["id"] + "(" + ",".join(p["roles"]) + ")" for p in j["peers"])')"
[ -n "$(in_root find /var/lib/latentmesh -user latentmesh -name identity.key)" ] ||
	die "the installed agent kept no identity.key in /var/lib/latentmesh"

curl -sf -X POST "http://127.0.0.1:$host_http/v1/jobs" -H 'Content-Type: application/json' \
	-d '{"prompt":"a red fox in a snowy forest","width":64,"height":64,"steps":2,"seed":1}' \
	>"$work/job.json" || die "POST /v1/jobs failed"
job=$(json "$work/job.json" 'j["id"]')
curl -sf "http://127.0.0.1:$host_http/v1/jobs/$job?wait=60s" >"$work/job.json" || die "GET /v1/jobs/$job failed"
state=$(json "$work/job.json" 'j["state"]')
[ "$state" = succeeded ] || die "job $job ended $state: $(cat "$work/job.json")"
denoiser=$(json "$work/job.json" 'j["stages"]["denoise"]["node"]')
[ "$denoiser" = deb-agent ] || die "job $job was denoised on $denoiser, not deb-agent"
curl -sf "http://127.0.0.1:$host_http/v1/jobs/$job/result" -o "$work/result.png" || die "no result for $job"
log "job $job: $state, denoise on deb-agent, result $(stat -c %s "$work/result.png") bytes"

# --- 6. drain on SIGTERM -------------------------------------------------
kill -TERM "$deb_pid"
rc=0
wait "$deb_pid" || rc=$?
[ "$rc" -eq 0 ] || die "the installed agent exited $rc on SIGTERM: $(tail -5 "$work/deb-agent.log")"
log "deb-agent drained and exited 0 on SIGTERM"
log "PASS in $(($(date +%s) - t0)) s"
