// Package httpapi owns the HTTP surface of an agent: the client API
// (OpenAI-shaped POST /v1/images/generations and the native /v1/jobs
// resource), the admin endpoint (probes, metrics, status, pprof), the
// Prometheus metrics the agent updates, and the Go client and
// `latentmesh generate` command that speak the client API.
//
// The package knows nothing of how jobs run: the agent hands NewHandler
// something that satisfies Jobs. It may be imported by the agent and by
// cmd/latentmesh; it must not import them.
package httpapi
