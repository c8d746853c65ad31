package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/cache"
)

const storeUsage = `usage: latentmesh store <stat|ls> [flags]

  stat   objects and bytes by lease mode and tier, replicas, pending consumers,
         and the answering agent's own holdings
  ls     the object records (--job ID: one job's)
`

// runStore is `latentmesh store stat|ls`, read from an agent's admin endpoint.
func runStore(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "stat" && args[0] != "ls") {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprint(stdout, storeUsage)
			return 0
		}
		fmt.Fprint(stderr, storeUsage)
		return 2
	}
	sub := args[0]
	fs := newFlagSet("store "+sub, "[--admin URL] [flags]", stderr)
	var admin adminFlags
	admin.register(fs)
	var (
		job    = fs.String("job", "", "only the objects of job `ID`")
		asJSON = fs.Bool("json", false, "print the answer as JSON")
	)
	if code := parse(fs, args[1:]); code >= 0 {
		return code
	}
	q := url.Values{}
	if *job != "" {
		q.Set("job", *job)
	}
	if sub == "ls" {
		q.Set("objects", "true")
	}
	body, err := adminGet(ctx, &admin, "/v1/admin/store?"+q.Encode())
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh store %s: %v\n", sub, err)
		return 1
	}
	if *asJSON {
		_, err = stdout.Write(append(body, '\n'))
		return boolCode(err == nil)
	}
	var v agent.StoreView
	if err := json.Unmarshal(body, &v); err != nil {
		fmt.Fprintf(stderr, "latentmesh store %s: undecodable answer: %v\n", sub, err)
		return 1
	}
	if sub == "ls" {
		writeObjects(stdout, v.Objects)
		return 0
	}
	writeStoreStat(stdout, v)
	return 0
}

// writeStoreStat prints the Store's summary and one agent's holdings.
func writeStoreStat(w io.Writer, v agent.StoreView) {
	s := v.Summary
	fmt.Fprintf(w, "objects=%d bytes=%d copies=%d under_replicated=%d pending_consumers=%d expiring=%d\n\n",
		s.Objects, s.Bytes, s.Copies, s.UnderReplicated, s.PendingConsumers, s.Expiring)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tOBJECTS\tBYTES\tMEMORY COPIES\tMEMORY BYTES\tDISK COPIES\tDISK BYTES")
	modes := make([]string, 0, len(s.ByMode))
	for m := range s.ByMode {
		modes = append(modes, string(m))
	}
	slices.Sort(modes)
	for _, m := range modes {
		x := s.ByMode[cache.Mode(m)]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", m, x.Objects, x.Bytes, x.MemoryCopies, x.MemoryBytes, x.DiskCopies, x.DiskBytes)
	}
	tw.Flush()
	l := v.Local
	fmt.Fprintf(w, "\nagent %s: memory %d of %d bytes, disk %d of %d bytes, %d copies (%d staged, %d recovered from disk); puts=%d gets=%d spills=%d evictions=%d overflows=%d repairs=%d reannounced=%d collected=%d lost=%d\n",
		v.Node, l.MemoryUsed, l.MemoryCapacity, l.DiskUsed, l.DiskCapacity, l.Copies, l.Staged, l.Recovered,
		l.Puts, l.Gets, l.Spills, l.Evictions, l.Overflows, l.Repairs, l.Reannounced, l.Collected, l.Lost)
}

// writeObjects prints one line per object record.
func writeObjects(w io.Writer, recs []cache.Record) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "OBJECT\tMODE\tBYTES\tREPLICAS\tHOLDERS\tEXPIRES")
	for _, r := range recs {
		var hs []string
		for _, h := range r.Holders {
			hs = append(hs, h.Node+"("+string(h.Tier)+")")
		}
		exp := "-"
		if !r.ExpiresAt.IsZero() {
			exp = r.ExpiresAt.Local().Format(time.DateTime)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d/%d\t%s\t%s\n", r.ID, r.Mode, r.Size, len(r.Holders), r.Replicas, strings.Join(hs, ","), exp)
	}
	tw.Flush()
}
