#!/usr/bin/env bash
# package-deb.sh builds the latentmesh .deb into dist/ with nfpm
# (packaging/nfpm.yaml): the binary built with the rdma tag, the latentmesh
# user (sysusers.d), the systemd units, /etc/latentmesh and
# /var/lib/latentmesh, and a default /etc/latentmesh/agent.yaml (a conffile).
#
#   scripts/package-deb.sh            # dist/latentmesh_<version>_<arch>.deb
#   VERSION=0.2.0 scripts/package-deb.sh
#
# Needs Go, gcc and libibverbs-dev (scripts/install-deps.sh installs it) and
# dpkg-dev's dpkg-shlibdeps when present (else the Depends are written by
# hand). nfpm runs through `go run` at a pinned version (NFPM overrides the
# command). Prints the path of the package as its last line.
set -euo pipefail

NFPM_VERSION=v2.45.2
NFPM=${NFPM:-go run github.com/goreleaser/nfpm/v2/cmd/nfpm@$NFPM_VERSION}

log() { printf 'package-deb: %s\n' "$*" >&2; }
die() { printf 'package-deb: error: %s\n' "$*" >&2; exit 1; }

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

command -v go >/dev/null 2>&1 || die "go not found on PATH (Go 1.26 is needed)"
command -v gcc >/dev/null 2>&1 || die "gcc not found: the rdma build needs cgo (apt-get install gcc)"
[ -e /usr/include/infiniband/verbs.h ] ||
	die "infiniband/verbs.h not found: install libibverbs-dev (scripts/install-deps.sh)"
for f in scripts/latentmesh.sysusers scripts/latentmesh-agent.service \
	scripts/latentmesh-agent@.service scripts/latentmesh-engine@.service; do
	[ -f "$f" ] || die "$f is missing: the package ships it"
done

# The Debian version: $VERSION, else the nearest v* tag (git describe),
# else the source's release with the commit's time and hash, so that each
# commit's package sorts after the one before.
version=${VERSION:-}
if [ -z "$version" ] && git rev-parse --git-dir >/dev/null 2>&1; then
	if tag=$(git describe --tags --match 'v[0-9]*' --dirty=.dirty 2>/dev/null); then
		# v1.2.3-4-gabc1234 -> 1.2.3+4.gabc1234
		version=$(printf '%s' "${tag#v}" | sed -E 's/-([0-9]+)-g/+\1.g/')
	else
		release=$(sed -n 's/^const release = "\(.*\)"$/\1/p' agent/version.go)
		[ -n "$release" ] || die "no release constant in agent/version.go; set VERSION"
		when=$(TZ=UTC git log -1 --date=format-local:%Y%m%d%H%M%S --format=%cd)
		version="$release+git$when.$(git rev-parse --short=12 HEAD)"
		[ -z "$(git status --porcelain --untracked-files=no)" ] || version+=.dirty
	fi
fi
[ -n "$version" ] || die "cannot tell the version (no git checkout): set VERSION"
printf '%s' "$version" | grep -Eq '^[0-9][A-Za-z0-9.+~-]*$' ||
	die "version $version is not a Debian version (digits first; letters, digits, . + ~ -)"

arch=$(go env GOARCH)
build=dist/build
rm -rf "$build"
mkdir -p "$build"

# -buildvcs=true (this machine's GOFLAGS turn it off) stamps the commit
# into the binary, which `latentmesh version` and node records report.
log "building latentmesh $version ($arch, -tags rdma)"
CGO_ENABLED=1 go build -buildvcs=true -trimpath -tags rdma -ldflags='-s -w' \
	-o "$build/latentmesh" ./cmd/latentmesh
"$build/latentmesh" version >/dev/null || die "the built binary does not run"

# The units, with the binary where the package puts it (/usr/bin; the
# units in scripts/ name /usr/local/bin, where a hand install puts it).
for u in latentmesh-agent.service latentmesh-agent@.service latentmesh-engine@.service; do
	sed 's|/usr/local/bin/latentmesh|/usr/bin/latentmesh|g' "scripts/$u" >"$build/$u"
done
grep -q '^ExecStart=/usr/bin/latentmesh ' "$build/latentmesh-agent.service" ||
	die "scripts/latentmesh-agent.service: no ExecStart=/usr/local/bin/latentmesh line to point at /usr/bin"

# The default config, from `latentmesh config print` with every key
# commented out.
packaging/default-config.sh "$build/latentmesh" >"$build/agent.yaml"

# Depends: what the binary links (libc6, libibverbs1), with the versions
# dpkg-shlibdeps derives from the libraries' symbols files.
depends="libc6, libibverbs1"
if command -v dpkg-shlibdeps >/dev/null 2>&1; then
	tmp=$(mktemp -d)
	mkdir "$tmp/debian"
	printf 'Source: latentmesh\n\nPackage: latentmesh\nArchitecture: any\n' >"$tmp/debian/control"
	cp "$build/latentmesh" "$tmp/latentmesh"
	if out=$(cd "$tmp" && dpkg-shlibdeps -O -e latentmesh 2>/dev/null); then
		depends=${out#shlibs:Depends=}
	else
		log "dpkg-shlibdeps failed; Depends: $depends"
	fi
	rm -rf "$tmp"
else
	log "dpkg-shlibdeps not found (dpkg-dev); Depends: $depends, unversioned"
fi
case "$depends" in
*libibverbs1*) ;;
*) die "the binary does not link libibverbs (Depends: $depends): was it built without -tags rdma?" ;;
esac

log "nfpm $NFPM_VERSION: Depends: $depends"
LATENTMESH_VERSION=$version LATENTMESH_ARCH=$arch LATENTMESH_DEPENDS=$depends \
	$NFPM pkg --packager deb --config packaging/nfpm.yaml --target dist/ >&2
deb=dist/latentmesh_${version}_${arch}.deb
[ -f "$deb" ] || die "nfpm wrote no $deb"
echo "$root/$deb"
