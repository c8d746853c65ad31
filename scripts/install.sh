#!/usr/bin/env bash
# install.sh installs latentmesh on a Debian host, as root:
#
#   scripts/install.sh                     build the .deb from this checkout
#                                          (scripts/package-deb.sh), then install it
#   scripts/install.sh FILE.deb            install that package with apt, which
#                                          brings its Depends (libibverbs1)
#   scripts/install.sh BINARY              install a built binary without the
#                                          package: /usr/local/bin/latentmesh, the
#                                          user, directories, units in
#                                          /etc/systemd/system and a default config
#
# Running it again is harmless: the same package is left as it is, a binary is
# replaced only when it differs, and an existing /etc/latentmesh/agent.yaml or
# unit file is never overwritten by a binary install (the new one is written
# beside it as .new). Nothing is enabled or started; the last lines say how.
set -euo pipefail

log() { printf 'install: %s\n' "$*"; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }

here=$(cd "$(dirname "$0")" && pwd)
[ "$#" -le 1 ] || die "usage: install.sh [FILE.deb | BINARY]"
[ "$(id -u)" -eq 0 ] || die "must run as root (it installs into /usr and /etc)"
command -v dpkg >/dev/null 2>&1 || die "dpkg not found: this script supports Debian and derivatives only"

# installed_version prints the installed latentmesh package's version, or
# nothing.
installed_version() {
	dpkg-query -W -f='${Status} ${Version}' latentmesh 2>/dev/null |
		sed -n 's/^install ok installed //p'
}

install_deb() {
	local deb=$1 name version
	[ -f "$deb" ] || die "$deb: no such file"
	name=$(dpkg-deb -f "$deb" Package) || die "$deb is not a Debian package"
	[ "$name" = latentmesh ] || die "$deb is package $name, not latentmesh"
	version=$(dpkg-deb -f "$deb" Version)
	if [ "$(installed_version)" = "$version" ]; then
		log "latentmesh $version already installed"
	else
		command -v apt-get >/dev/null 2>&1 || die "apt-get not found"
		log "installing latentmesh $version from $deb"
		# apt resolves the Depends; a path with a slash marks a local file.
		case "$deb" in /*) ;; *) deb=./$deb ;; esac
		DEBIAN_FRONTEND=noninteractive apt-get -y -o DPkg::Lock::Timeout=300 \
			--no-install-recommends install "$deb" ||
			die "apt-get install $deb failed (apt-get update first if it could not find libibverbs1)"
		[ "$(installed_version)" = "$version" ] || die "dpkg does not list latentmesh $version as installed"
	fi
	next_steps
}

# put SRC DST MODE installs SRC at DST unless DST exists with other content,
# in which case SRC goes to DST.new and the operator merges.
put() {
	local src=$1 dst=$2 mode=$3
	if [ ! -e "$dst" ]; then
		install -D -m "$mode" "$src" "$dst"
		log "wrote $dst"
	elif cmp -s "$src" "$dst"; then
		:
	else
		install -m "$mode" "$src" "$dst.new"
		log "kept $dst (yours differs); the new one is $dst.new"
	fi
}

install_binary() {
	local bin=$1 tmp libs
	[ -f "$bin" ] && [ -x "$bin" ] || die "$bin: not an executable file"
	libs=$(ldd "$bin" 2>/dev/null || true)
	if [[ $libs == *"libibverbs.so.1 => not found"* ]]; then
		die "$bin links libibverbs (built with -tags rdma): apt-get install libibverbs1 ibverbs-providers"
	fi
	"$bin" version >/dev/null 2>&1 || die "$bin does not run here (built for another system? a .deb needs the .deb path)"
	if [ -n "$(installed_version)" ]; then
		die "the latentmesh package is installed ($(installed_version)): upgrade it with a .deb, or remove it first (apt-get remove latentmesh)"
	fi
	for f in latentmesh.sysusers latentmesh-agent.service latentmesh-agent@.service latentmesh-engine@.service; do
		[ -f "$here/$f" ] || die "$here/$f is missing: run this script from a latentmesh checkout"
	done

	if cmp -s "$bin" /usr/local/bin/latentmesh; then
		log "/usr/local/bin/latentmesh is already this binary"
	else
		install -D -m 0755 "$bin" /usr/local/bin/latentmesh.tmp
		mv -f /usr/local/bin/latentmesh.tmp /usr/local/bin/latentmesh
		log "installed /usr/local/bin/latentmesh ($(/usr/local/bin/latentmesh version))"
	fi

	# The user: systemd-sysusers from the same file the package ships, else
	# useradd with the same fields.
	put "$here/latentmesh.sysusers" /etc/sysusers.d/latentmesh.conf 0644
	if command -v systemd-sysusers >/dev/null 2>&1; then
		systemd-sysusers /etc/sysusers.d/latentmesh.conf
	elif ! getent passwd latentmesh >/dev/null; then
		getent group latentmesh >/dev/null || groupadd --system latentmesh
		useradd --system --gid latentmesh --home-dir /var/lib/latentmesh --no-create-home \
			--shell /usr/sbin/nologin --comment "latentmesh agent" latentmesh
	fi
	getent passwd latentmesh >/dev/null || die "user latentmesh was not created"

	install -d -o root -g latentmesh -m 0750 /etc/latentmesh
	install -d -o latentmesh -g latentmesh -m 0700 /var/lib/latentmesh

	tmp=$(mktemp)
	"$here/../packaging/default-config.sh" /usr/local/bin/latentmesh >"$tmp" || {
		rm -f "$tmp"
		die "cannot write the default config with /usr/local/bin/latentmesh config print"
	}
	put "$tmp" /etc/latentmesh/agent.yaml 0640
	rm -f "$tmp"
	chgrp latentmesh /etc/latentmesh/agent.yaml

	for u in latentmesh-agent.service latentmesh-agent@.service latentmesh-engine@.service; do
		put "$here/$u" "/etc/systemd/system/$u" 0644
	done
	if [ -d /run/systemd/system ]; then
		systemctl daemon-reload
	fi
	next_steps
}

next_steps() {
	log "done. Next: set etcd-endpoints (and roles, addresses, secrets) in /etc/latentmesh/agent.yaml"
	log "  (docs/operations.md), check with: latentmesh config print"
	log "  then: systemctl enable --now latentmesh-agent   # or latentmesh-agent@0 latentmesh-engine@0 per GPU"
}

if [ "$#" -eq 0 ]; then
	log "building the package from $(cd "$here/.." && pwd)"
	deb=$("$here/package-deb.sh") || die "scripts/package-deb.sh failed"
	install_deb "$deb"
	exit 0
fi
case "$1" in
-h | --help)
	sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
	exit 0
	;;
*.deb) install_deb "$1" ;;
*)
	if [ -f "$1" ] && dpkg-deb -f "$1" Package >/dev/null 2>&1; then
		install_deb "$1"
	else
		install_binary "$1"
	fi
	;;
esac
