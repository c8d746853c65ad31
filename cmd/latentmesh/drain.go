package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// runDrain asks one agent, through its admin endpoint, to stop taking work,
// finish or requeue its running tasks and leave the mesh (its process then
// exits 0), and waits until it has.
func runDrain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("drain", "[--admin URL] [--token-file FILE] [--ca-file FILE] [--wait=false]", stderr)
	var admin adminFlags
	admin.register(fs)
	var (
		wait    = fs.Bool("wait", true, "wait until the agent has drained (false: return once it started)")
		timeout = fs.Duration("timeout", 2*time.Minute, "how long to wait for the drain (the agent's --drain-timeout plus the requeues)")
	)
	if code := parse(fs, args); code >= 0 {
		return code
	}
	token, client, err := admin.client()
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh drain: %v\n", err)
		return 2
	}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	url := fmt.Sprintf("%s/v1/admin/drain?wait=%t", strings.TrimRight(admin.url, "/"), *wait)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, nil)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh drain: %v\n", err)
		return 2
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh drain: cannot reach agent admin at %s: %v\n", admin.url, err)
		return 1
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusAccepted {
		fmt.Fprintf(stderr, "latentmesh drain: %s: %s\n", resp.Status, strings.TrimSpace(string(body)))
		return 1
	}
	if *wait {
		fmt.Fprintln(stdout, "drained; the agent is leaving the mesh")
	} else {
		fmt.Fprintln(stdout, "draining")
	}
	return 0
}
