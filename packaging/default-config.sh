#!/bin/sh
# default-config.sh BINARY prints the default /etc/latentmesh/agent.yaml:
# `BINARY config print` (every key with its help, from the one table of
# defaults that flags use too) run in an empty environment as the unit runs
# the agent, with each key commented out, so that the binary's defaults
# apply until an operator sets one (an upgrade that changes a default then
# changes it here too, even where dpkg keeps an edited file).
set -eu
bin=${1:?usage: default-config.sh BINARY}
cat <<'HEAD'
# /etc/latentmesh/agent.yaml: the latentmesh agent's configuration. The
# agent reads it unless told otherwise (--config), so every unit does:
# latentmesh-agent and each latentmesh-agent@GPU instance. Every key is
# commented out at its default; uncomment a key to set it. A node needs at
# least etcd-endpoints (roles: all three stages). LATENTMESH_<KEY> variables (e.g. in
# /etc/latentmesh/agent.env) and --<key> flags ($LATENTMESH_FLAGS,
# $INSTANCE_FLAGS) override this file; `latentmesh config print` shows the
# result. Keys and defaults: /usr/share/doc/latentmesh/config.md; a
# multi-node set-up: /usr/share/doc/latentmesh/operations.md.
#
# Keep secrets out of this file: admin-token-file, api-tokens,
# etcd-password-file and gossip-keyring name files that only the
# latentmesh user reads (0600; the agent warns about a keyring that the
# group or others can read).

HEAD
env -i PATH=/usr/bin:/bin STATE_DIRECTORY=/var/lib/latentmesh "$bin" config print |
	sed -e '1,/^$/d' -e 's/^\([a-z][a-z0-9-]*:\)/#\1/'
