package httpapi

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// RunGenerate is `latentmesh generate`: it submits one job to a server,
// draws its progress on stderr and writes the output to the -o file. It
// returns the process exit code: 0 on success, 2 for bad flags, 1 for
// anything else.
func RunGenerate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("latentmesh generate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		server   = fs.String("server", "http://127.0.0.1:8080", "agent client API `URL`")
		prompt   = fs.String("prompt", "", "what to draw (required)")
		negative = fs.String("negative-prompt", "", "what not to draw")
		seed     = fs.Int64("seed", 0, "random seed (default: chosen by the server)")
		steps    = fs.Int("steps", 0, "denoising steps (default: server's)")
		size     = fs.String("size", "", "output size `WxH` (default: server's)")
		frames   = fs.Int("frames", 0, "frames; more than 1 makes a GIF (default 1)")
		guidance = fs.Float64("guidance", 0, "classifier-free guidance scale (default: server's)")
		priority = fs.String("priority", "", "interactive, standard or batch (default standard)")
		out      = fs.String("o", "", "output `FILE` (required)")
		token    = fs.String("token-file", "", "`FILE` holding the API bearer token (first line), for an agent run with --api-tokens")
		caFile   = fs.String("ca-file", "", "CA `FILE` (PEM) that signed the agent's certificate, for an https:// --server (default: system roots)")
	)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: latentmesh generate --prompt TEXT -o FILE [flags]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	usageErr := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "latentmesh generate: "+format+"\n", a...)
		fs.Usage()
		return 2
	}
	if fs.NArg() > 0 {
		return usageErr("unexpected argument %q", fs.Arg(0))
	}
	if u, err := url.Parse(*server); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return usageErr("--server %q: want a URL such as http://127.0.0.1:8080", *server)
	}
	if *prompt == "" {
		return usageErr("--prompt is required")
	}
	if *out == "" {
		return usageErr("-o FILE is required")
	}

	req := JobRequest{Prompt: *prompt, NegativePrompt: *negative, Priority: *priority}
	var bad error
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "seed":
			req.Seed = seed
		case "steps":
			req.Steps = steps
		case "frames":
			req.Frames = frames
		case "guidance":
			req.GuidanceScale = guidance
		case "size":
			w, h, err := parseSize(*size)
			if err != nil {
				bad = err
				return
			}
			req.Width, req.Height = &w, &h
		}
	})
	if bad != nil {
		return usageErr("--%v", bad)
	}

	// A transport of our own, so that idle connections die with the command.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	defer tr.CloseIdleConnections()
	var err error
	if tr.TLSClientConfig, err = ClientTLS(*caFile); err != nil {
		return usageErr("--ca-file: %v", err)
	}
	c := &Client{BaseURL: *server, HTTP: &http.Client{Transport: tr}}
	if *token != "" {
		b, err := os.ReadFile(*token)
		if err != nil {
			return usageErr("--token-file: %v", err)
		}
		line, _, _ := strings.Cut(string(b), "\n")
		c.Token = strings.TrimSpace(line)
	}

	bar := &progressBar{w: stderr}
	job, data, err := c.Generate(ctx, req, bar.update)
	bar.finish()
	if err != nil {
		return reportGenerateError(ctx, c, job, *server, err, stderr)
	}
	if err := writeFileAtomic(*out, data); err != nil {
		fmt.Fprintf(stderr, "latentmesh generate: job %s succeeded but writing the output failed: %v\n", job.ID, err)
		return 1
	}
	fmt.Fprintf(stdout, "job %s: wrote %s (%d bytes, seed %d, %s)\n",
		job.ID, *out, len(data), job.Spec.Seed, contentTypeOf(job))
	return 0
}

func contentTypeOf(job jobs.Job) string {
	if job.Result != nil && job.Result.ContentType != "" {
		return job.Result.ContentType
	}
	return "unknown type"
}

func reportGenerateError(ctx context.Context, c *Client, job jobs.Job, server string, err error, stderr io.Writer) int {
	var apiErr *APIError
	switch {
	case errors.As(err, &apiErr):
		prefix := "server error"
		if job.ID != "" {
			prefix = "job " + job.ID
		}
		fmt.Fprintf(stderr, "latentmesh generate: %s: %s", prefix, apiErr.Message)
		if apiErr.Code != "" {
			fmt.Fprintf(stderr, " (%s)", apiErr.Code)
		}
		fmt.Fprintln(stderr)
	case ctx.Err() != nil:
		fmt.Fprintf(stderr, "latentmesh generate: interrupted")
		if job.ID != "" && !job.State.Terminal() {
			// The job is durable; nobody will collect it, so withdraw it.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_, cerr := c.Cancel(cctx, job.ID)
			cancel()
			if cerr == nil {
				fmt.Fprintf(stderr, "; cancelled job %s", job.ID)
			} else {
				fmt.Fprintf(stderr, "; job %s may still run", job.ID)
			}
		}
		fmt.Fprintln(stderr)
	default:
		fmt.Fprintf(stderr, "latentmesh generate: cannot reach server at %s: %v\n", server, err)
	}
	return 1
}

// writeFileAtomic writes data to a temporary file beside path and renames
// it into place, so that path holds either the old file or the whole new one.
func writeFileAtomic(path string, data []byte) (err error) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Chmod(0o644); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// progressBar draws one status line, redrawn in place with \r and only
// when it changes.
type progressBar struct {
	w    io.Writer
	last string
}

const barWidth = 20

func (p *progressBar) update(job jobs.Job) {
	frac, label := jobProgress(job)
	filled := int(frac * barWidth)
	line := fmt.Sprintf("[%s%s] %s", strings.Repeat("#", filled), strings.Repeat(".", barWidth-filled), label)
	if line == p.last {
		return
	}
	pad := ""
	if n := len(p.last) - len(line); n > 0 {
		pad = strings.Repeat(" ", n)
	}
	fmt.Fprintf(p.w, "\r%s%s", line, pad)
	p.last = line
}

func (p *progressBar) finish() {
	if p.last != "" {
		fmt.Fprintln(p.w)
	}
}

// jobProgress places the job on one bar: encode takes the first 5%,
// denoise (by step) the next 90%, decode the rest.
func jobProgress(job jobs.Job) (float64, string) {
	switch job.State {
	case jobs.Succeeded:
		return 1, "done"
	case jobs.Failed, jobs.Cancelled:
		return 0, string(job.State)
	case jobs.Queued, "":
		if job.Stage == "" || job.Stage == jobs.Encode {
			return 0, "queued"
		}
	}
	stage := job.Stage
	if pr := job.Progress; pr != nil && pr.Stage != "" {
		stage = pr.Stage
	}
	suffix := ""
	if job.State == jobs.Queued {
		suffix = " (queued)"
	}
	switch stage {
	case jobs.Encode:
		return 0.02, "encode" + suffix
	case jobs.Denoise:
		if pr := job.Progress; pr != nil && pr.Stage == jobs.Denoise && pr.Total > 0 {
			step := min(max(pr.Step, 0), pr.Total)
			return 0.05 + 0.9*float64(step)/float64(pr.Total), fmt.Sprintf("denoise %d/%d", step, pr.Total)
		}
		return 0.05, "denoise" + suffix
	case jobs.Decode:
		return 0.95, "decode" + suffix
	}
	return 0, string(job.State)
}
