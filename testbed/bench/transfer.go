package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// Transports RunTransfer knows, the values of TransferConfig.Transports.
const (
	TransportTCP = transfer.TransportTCP
	// TransportShm gives two rows per size: "shm" (PullInto, copying from
	// the producer's arena into the consumer's) and "shm-view" (PullView, a
	// zero-copy handoff of the producer's memory).
	TransportShm = transfer.TransportShm
	rowShmView   = "shm-view"
)

// TransferConfig configures RunTransfer.
type TransferConfig struct {
	// Sizes are the payload sizes measured, in bytes.
	Sizes []int64
	// Transports are the transports measured, each against its baseline.
	Transports []string
	// Conns is the number of TCP connections a pull stripes across, for the
	// transfer service and the raw-TCP baseline alike.
	Conns int
	// Reps is the number of measured repetitions per size, after one warm-up.
	Reps int
	// Chunks is the chunk count of the chunked pull measured beside each
	// whole pull (time to first chunk); 1 skips it. Sizes must divide by it.
	Chunks int
	// Transfer is the consumer's transfer configuration; Conns overrides
	// its Conns, and each transport's rows force its Transport (with an
	// arena sized for the largest payload for shm).
	Transfer transfer.Config
	// Producer is the producer command; it must run ServeProducer on its
	// stdin and stdout. ProducerEnv is added to its environment.
	Producer    []string
	ProducerEnv []string
	// Progress, if not nil, receives a line per step of a long run.
	Progress io.Writer
	// Logger receives the consumer's logs.
	Logger *zap.Logger
}

// DefaultTransferConfig measures the sizes and connection count of the
// issue's acceptance criteria.
func DefaultTransferConfig() TransferConfig {
	return TransferConfig{
		Sizes:      []int64{4 << 20, 64 << 20, 256 << 20}, // small, typical, large latent
		Transports: []string{TransportTCP, TransportShm},  // every transport one host can run
		Conns:      4,                                     // transfer's default: saturates loopback
		Reps:       5,                                     // an odd count gives a true median
		Chunks:     8,                                     // frames of a short video latent
		Transfer:   transfer.DefaultConfig(),
		Producer:   ProducerCommand(),
		Logger:     zap.NewNop(),
	}
}

func (c TransferConfig) validate() error {
	switch {
	case len(c.Sizes) == 0:
		return errors.New("bench: no sizes")
	case len(c.Transports) == 0:
		return errors.New("bench: no transports")
	case c.Conns < 1 || c.Conns > 64:
		return fmt.Errorf("bench: conns %d not in [1,64]", c.Conns)
	case c.Reps < 1:
		return fmt.Errorf("bench: reps %d < 1", c.Reps)
	case c.Chunks < 1:
		return fmt.Errorf("bench: chunks %d < 1", c.Chunks)
	case c.Logger == nil:
		return errors.New("bench: nil logger")
	}
	for _, s := range c.Sizes {
		if s <= 0 || s%int64(c.Chunks) != 0 {
			return fmt.Errorf("bench: size %d is not a positive multiple of %d chunks", s, c.Chunks)
		}
	}
	return checkTransports(c.Transports)
}

// TransferResult is one row: one transport at one size.
type TransferResult struct {
	Transport string `json:"transport"`
	SizeBytes int64  `json:"size_bytes"`
	Conns     int    `json:"conns"`
	// GB/s (1e9 bytes per second) of the transfer pulls.
	GbpsMedian float64 `json:"gbps_median"`
	GbpsMin    float64 `json:"gbps_min"`
	GbpsMax    float64 `json:"gbps_max"`
	// BaselineGbpsMedian is the median of the baseline (raw TCP for tcp,
	// memcpy for shm) measured interleaved with the pulls.
	BaselineGbpsMedian float64 `json:"baseline_gbps_median"`
	RatioVsBaseline    float64 `json:"ratio_vs_baseline"`
	// TunedBaselineGbpsMedian is raw TCP with the data plane's congestion
	// control (tcp rows, when it is not the system default), also
	// interleaved: the ratio against it is what the connector itself costs,
	// apart from the socket tuning.
	TunedBaselineGbpsMedian float64 `json:"tuned_baseline_gbps_median,omitempty"`
	RatioVsTunedBaseline    float64 `json:"ratio_vs_tuned_baseline,omitempty"`
	// AllocsPerOp is the consumer's heap allocations per pull.
	AllocsPerOp float64 `json:"allocs_per_op"`
	// HandoffMSMedian is the median time PullView takes to hand over the
	// producer's memory (shm-view rows only).
	HandoffMSMedian float64 `json:"handoff_ms_median,omitempty"`
	// Chunks, FirstChunkMSMedian and WholeMSMedian describe the chunked
	// pull of the same size: time until the first chunk is usable and until
	// the whole payload is (0 when Chunks is 1).
	Chunks             int     `json:"chunks"`
	FirstChunkMSMedian float64 `json:"first_chunk_ms_median"`
	WholeMSMedian      float64 `json:"whole_ms_median"`
}

// TransferReport is RunTransfer's result, as `bench transfer --json` prints it.
type TransferReport struct {
	Results []TransferResult `json:"results"`
}

// RunTransfer starts the producer process and measures every transport at
// every size.
func RunTransfer(ctx context.Context, cfg TransferConfig) (_ *TransferReport, err error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.Transfer.Conns = cfg.Conns
	cfg.Transfer.Logger = cfg.Logger
	// The producer holds each size whole and chunked at once.
	arenaBytes := 2*slices.Max(cfg.Sizes) + 16<<20
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c, err := startChild(ctx, cfg.Producer, cfg.ProducerEnv, request{ArenaBytes: arenaBytes, TCPCongestion: cfg.Transfer.TCPCongestion})
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := c.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	raw, err := dialRaw(ctx, c.hello.RawAddr, cfg.Conns)
	if err != nil {
		return nil, err
	}
	defer raw.close()
	var tuned *rawClient // nil when the data plane keeps the system default
	if c.hello.RawTunedAddr != "" {
		if tuned, err = dialRaw(ctx, c.hello.RawTunedAddr, cfg.Conns); err != nil {
			return nil, err
		}
		defer tuned.close()
	}

	rep := &TransferReport{}
	for _, t := range cfg.Transports {
		rows, err := runTransport(ctx, cfg, c, raw, tuned, t)
		if err != nil {
			return nil, err
		}
		rep.Results = append(rep.Results, rows...)
	}
	return rep, nil
}

// runTransport measures one transport at every size, with a consumer
// service of its own forced to that transport.
func runTransport(ctx context.Context, cfg TransferConfig, c *child, raw, tuned *rawClient, transport string) (_ []TransferResult, err error) {
	tcfg := cfg.Transfer
	tcfg.Transport = transport
	if transport == TransportShm {
		tcfg.Arena = arena.DefaultConfig()
		tcfg.Arena.Name = "latentmesh-bench-consumer"
		tcfg.Arena.Size = slices.Max(cfg.Sizes) + 16<<20 // one destination
	}
	h, err := newHost(loopback)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	svc, err := transfer.New(tcfg, h)
	if err != nil {
		return nil, err
	}
	defer svc.Close()
	r := &transferRun{cfg: cfg, c: c, svc: svc, raw: raw, tuned: tuned}
	var rows []TransferResult
	for _, size := range cfg.Sizes {
		res, err := r.measure(ctx, transport, size)
		if err != nil {
			return nil, fmt.Errorf("bench: %s %s: %w", transport, bytesize.Format(size), err)
		}
		rows = append(rows, res...)
	}
	return rows, nil
}

// transferRun measures one transport through svc.
type transferRun struct {
	cfg TransferConfig
	c   *child
	svc *transfer.Service
	raw *rawClient
	// tuned is the raw-TCP baseline running the data plane's congestion
	// control; nil when that is the system default.
	tuned *rawClient
}

func (r *transferRun) progress(format string, a ...any) {
	if r.cfg.Progress != nil {
		fmt.Fprintf(r.cfg.Progress, "bench transfer: "+format+"\n", a...)
	}
}

// stripes is how many ranges the transfer service splits an unchunked
// payload into (Conns, fewer for payloads under Conns*MinStripe); the raw
// baseline uses as many.
func (r *transferRun) stripes(size int64) int {
	n := (size + r.cfg.Transfer.MinStripe - 1) / r.cfg.Transfer.MinStripe
	return int(max(min(int64(r.cfg.Conns), n), 1))
}

// op is one timed operation of a repetition.
type op func() (time.Duration, error)

// measure runs the warm-up and the interleaved repetitions of one size: a
// row for tcp, two (shm, shm-view) for shm.
func (r *transferRun) measure(ctx context.Context, transport string, size int64) ([]TransferResult, error) {
	whole, err := r.c.call(request{Op: opPublish, Size: size, Chunks: 1})
	if err != nil {
		return nil, err
	}
	defer r.c.call(request{Op: opRelease, ID: whole.Ref.ID})
	var chunked response
	if r.cfg.Chunks > 1 {
		if chunked, err = r.c.call(request{Op: opPublish, Size: size, Chunks: r.cfg.Chunks}); err != nil {
			return nil, err
		}
		defer r.c.call(request{Op: opRelease, ID: chunked.Ref.ID})
	}
	if got := r.svc.TransportFor(whole.Ref); got != transport {
		return nil, fmt.Errorf("pulls would use transport %q, not %q", got, transport)
	}
	// The destination comes from Alloc: the arena for shm, else the heap.
	buf, err := r.svc.Alloc(size)
	if err != nil {
		return nil, err
	}
	defer buf.Release()
	dst := buf.Bytes()
	base, src := make([]byte, size), []byte(nil)
	touch(dst)
	touch(base)

	pull := func() (time.Duration, error) {
		t0 := time.Now()
		err := r.svc.PullInto(ctx, whole.Ref, dst)
		return time.Since(t0), err
	}
	rawPull := func(c *rawClient) op {
		return func() (time.Duration, error) {
			t0 := time.Now()
			err := c.pull(whole.RawKey, base, r.stripes(size))
			return time.Since(t0), err
		}
	}
	var baseline, tunedBaseline op
	if transport == TransportTCP {
		baseline = rawPull(r.raw)
		if r.tuned != nil {
			tunedBaseline = rawPull(r.tuned)
		}
	} else {
		src = make([]byte, size)
		fill(src, uint64(size))
		baseline = func() (time.Duration, error) {
			t0 := time.Now()
			copy(base, src)
			return time.Since(t0), nil
		}
	}
	view := func() (time.Duration, error) {
		t0 := time.Now()
		v, release, err := r.svc.PullView(ctx, whole.Ref)
		d := time.Since(t0)
		if err != nil {
			return 0, err
		}
		n := len(v)
		release()
		if int64(n) != size {
			return 0, fmt.Errorf("view of %d bytes, want %d", n, size)
		}
		return d, nil
	}
	chunkedPull := func() (first, all time.Duration, err error) {
		t0 := time.Now()
		p, err := r.svc.PullChunks(ctx, chunked.Ref, dst)
		if err != nil {
			return 0, 0, err
		}
		n := 0
		for range p.Chunks() {
			if n == 0 {
				first = time.Since(t0)
			}
			n++
		}
		if err := p.Wait(); err != nil {
			return 0, 0, err
		}
		all = time.Since(t0)
		if n != r.cfg.Chunks {
			return 0, 0, fmt.Errorf("chunked pull yielded %d of %d chunks", n, r.cfg.Chunks)
		}
		return first, all, nil
	}

	// Warm up: dial the pools and shm peers, fault in both ends' pages.
	r.progress("%s %s: warm-up", transport, bytesize.Format(size))
	if _, err := pull(); err != nil {
		return nil, err
	}
	if _, err := baseline(); err != nil {
		return nil, err
	}
	if transport == TransportTCP && !slices.Equal(dst, base) {
		return nil, errors.New("transfer and raw-TCP baseline delivered different bytes")
	}
	if tunedBaseline != nil {
		if _, err := tunedBaseline(); err != nil {
			return nil, err
		}
	}
	if transport == TransportShm {
		if _, err := view(); err != nil {
			return nil, err
		}
	}
	if r.cfg.Chunks > 1 {
		if _, _, err := chunkedPull(); err != nil {
			return nil, err
		}
	}

	var rates, baseRates, tunedRates, viewMS, firsts, alls []float64
	var mallocs, viewMallocs uint64
	counted := func(o op, n *uint64) (time.Duration, error) {
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		d, err := o()
		runtime.ReadMemStats(&m1)
		*n += m1.Mallocs - m0.Mallocs
		return d, err
	}
	for i := range r.cfg.Reps {
		r.progress("%s %s: rep %d/%d", transport, bytesize.Format(size), i+1, r.cfg.Reps)
		d, err := counted(pull, &mallocs)
		if err != nil {
			return nil, err
		}
		rates = append(rates, gbps(size, d))
		if d, err = baseline(); err != nil {
			return nil, err
		}
		baseRates = append(baseRates, gbps(size, d))
		if tunedBaseline != nil {
			if d, err = tunedBaseline(); err != nil {
				return nil, err
			}
			tunedRates = append(tunedRates, gbps(size, d))
		}
		if transport == TransportShm {
			if d, err = counted(view, &viewMallocs); err != nil {
				return nil, err
			}
			viewMS = append(viewMS, ms(d))
		}
		if r.cfg.Chunks > 1 {
			first, all, err := chunkedPull()
			if err != nil {
				return nil, err
			}
			firsts = append(firsts, ms(first))
			alls = append(alls, ms(all))
		}
	}
	b := summarize(baseRates)
	row := func(name string, rates []float64, mallocs uint64) TransferResult {
		s := summarize(rates)
		res := TransferResult{
			Transport: name, SizeBytes: size, Conns: r.cfg.Conns,
			GbpsMedian: s.median, GbpsMin: s.min, GbpsMax: s.max,
			BaselineGbpsMedian: b.median,
			AllocsPerOp:        float64(mallocs) / float64(r.cfg.Reps),
			Chunks:             r.cfg.Chunks,
			FirstChunkMSMedian: summarize(firsts).median,
			WholeMSMedian:      summarize(alls).median,
		}
		if b.median > 0 {
			res.RatioVsBaseline = s.median / b.median
		}
		if tb := summarize(tunedRates); tb.median > 0 {
			res.TunedBaselineGbpsMedian = tb.median
			res.RatioVsTunedBaseline = s.median / tb.median
		}
		return res
	}
	rows := []TransferResult{row(transport, rates, mallocs)}
	if transport == TransportShm {
		// A view moves no bytes; its GB/s is the size over the handoff time,
		// what a copy would have to reach to be as fast.
		viewRates := make([]float64, len(viewMS))
		for i, m := range viewMS {
			viewRates[i] = float64(size) / (max(m, 1e-6) / 1e3) / 1e9
		}
		v := row(rowShmView, viewRates, viewMallocs)
		v.HandoffMSMedian = summarize(viewMS).median
		v.Chunks, v.FirstChunkMSMedian, v.WholeMSMedian = 0, 0, 0
		rows = append(rows, v)
	}
	return rows, nil
}

// WriteTable writes the report as aligned columns.
func (rep *TransferReport) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join([]string{"transport", "size", "conns", "GB/s med", "min", "max", "baseline GB/s", "ratio", "tuned GB/s", "ratio tuned", "allocs/op", "chunks", "first chunk ms", "whole ms", "handoff ms", ""}, "\t"))
	for _, x := range rep.Results {
		tuned, tunedRatio, chunks, first, whole, handoff := "-", "-", "-", "-", "-", "-"
		if x.TunedBaselineGbpsMedian > 0 {
			tuned, tunedRatio = fmt.Sprintf("%.2f", x.TunedBaselineGbpsMedian), fmt.Sprintf("%.2f", x.RatioVsTunedBaseline)
		}
		if x.Chunks > 1 {
			chunks, first, whole = fmt.Sprint(x.Chunks), fmt.Sprintf("%.1f", x.FirstChunkMSMedian), fmt.Sprintf("%.1f", x.WholeMSMedian)
		}
		if x.Transport == rowShmView {
			handoff = fmt.Sprintf("%.3f", x.HandoffMSMedian)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%s\t%s\t%.0f\t%s\t%s\t%s\t%s\t\n",
			x.Transport, bytesize.Format(x.SizeBytes), x.Conns, x.GbpsMedian, x.GbpsMin, x.GbpsMax,
			x.BaselineGbpsMedian, x.RatioVsBaseline, tuned, tunedRatio, x.AllocsPerOp, chunks, first, whole, handoff)
	}
	return tw.Flush()
}

// checkTransports accepts the transports the benchmarks compare: tcp, shm.
func checkTransports(ts []string) error {
	for _, t := range ts {
		switch t {
		case TransportTCP, TransportShm:
		default:
			return fmt.Errorf("bench: unknown transport %q (want tcp or shm)", t)
		}
	}
	return nil
}
