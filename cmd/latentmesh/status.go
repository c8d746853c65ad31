package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("status", "[--admin URL] [flags]", stderr)
	var admin adminFlags
	admin.register(fs)
	asJSON := fs.Bool("json", false, "print the status document as JSON")
	if code := parse(fs, args); code >= 0 {
		return code
	}
	body, err := adminGet(ctx, &admin, "/v1/admin/status")
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh status: %v\n", err)
		return 1
	}
	if *asJSON {
		_, err = stdout.Write(append(body, '\n'))
		return boolCode(err == nil)
	}
	var st agent.Status
	if err := json.Unmarshal(body, &st); err != nil {
		fmt.Fprintf(stderr, "latentmesh status: undecodable status: %v\n", err)
		return 1
	}
	writeStatus(stdout, st)
	return 0
}

// adminGet reads path from an agent's admin endpoint, with its bearer token.
func adminGet(ctx context.Context, af *adminFlags, path string) ([]byte, error) {
	token, client, err := af.client()
	if err != nil {
		return nil, err
	}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	admin := af.url
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(admin, "/")+path, nil)
	if err != nil {
		return nil, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("cannot reach agent admin at %s: %w", admin, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}

func boolCode(ok bool) int {
	if ok {
		return 0
	}
	return 1
}

// writeStatus prints a status document for a person.
func writeStatus(w io.Writer, st agent.Status) {
	fmt.Fprintf(w, "node %s (%s) roles=%s http=%s version=%s\n", st.Node.ID, st.Node.Host,
		strings.Join(st.Node.Roles, ","), st.Node.HTTPAddr, st.Node.Version)
	d := st.Data
	fmt.Fprintf(w, "data plane: transport=%s held=%d payloads (%d bytes) arena free=%d of %d bytes pulls=%v\n\n",
		d.Transport, d.HeldPayloads, d.HeldBytes, d.ArenaFree, d.ArenaBytes, d.Pulls)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "QUEUE\tQUEUED\tRUNNING")
	for _, s := range jobs.Stages() { // pipeline order
		if q, ok := st.Queues[s]; ok {
			fmt.Fprintf(tw, "%s\t%d\t%d\n", s, q.Queued, q.Running)
		}
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "PEER\tROLES\tALIVE\tFREE CREDITS\tLOAD\tHTTP")
	for _, p := range st.Peers {
		alive := "yes"
		switch {
		case !p.Alive:
			alive = "no"
		case p.Suspect:
			alive = "suspect"
		}
		var free []string
		for _, r := range p.Roles {
			free = append(free, fmt.Sprintf("%s=%d", r, p.Free[r]))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2f\t%s\n", p.ID, strings.Join(p.Roles, ","), alive, strings.Join(free, ","), p.Load, p.HTTP)
	}
	tw.Flush()
}
