package agent

import (
	"runtime/debug"
)

// release is the version of this source tree; a build from a tagged module
// reports the tag instead.
const release = "0.1.0"

// Version is reported in node records and `latentmesh version`: the
// commit the binary was built from and whether its tree had changes, as
// the Go toolchain stamps them (go build in a git checkout, unless
// -buildvcs=false), else the release alone.
var Version = buildVersion(debug.ReadBuildInfo())

func buildVersion(info *debug.BuildInfo, ok bool) string {
	v := release
	if !ok {
		return v
	}
	if mv := info.Main.Version; mv != "" && mv != "(devel)" {
		// A module version (go install …@v1.2.3), or the pseudo-version
		// Go 1.24+ derives from the checkout, which names the commit and
		// ends in +dirty for a changed tree.
		return mv
	}
	var rev string
	dirty := false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return v
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	v += "+" + rev
	if dirty {
		v += ".dirty"
	}
	return v
}
