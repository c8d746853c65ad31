package extengine

// The batching check of `engine check` (batch.go): tasks sent as one batch
// each get their own result, that of the same task run alone (within a
// rounding: a batched network may sum in another order), in one engine
// call; and a member cancelled mid-denoise stops alone while the others
// finish.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"
)

// batchChecks runs the batch check for each stage a model batches.
func (c *checker) batchChecks(ctx context.Context, reg *Registration) []CheckResult {
	if !reg.Supports(FeatureBatch) {
		return nil
	}
	var out []CheckResult
	for _, st := range []string{StageEncode, StageDenoise, StageDecode} {
		for _, m := range reg.Models {
			if n := reg.MaxBatch(st, m.Name); n > 1 {
				out = append(out, c.batchCheck(ctx, m, st, n))
				break
			}
		}
	}
	return out
}

// batchMember is member i of a check's batch: its own prompt, seed and
// input, so that results mixed up between members show.
func (c *checker) batchMember(m Model, st string, steps, i int) (Request, error) {
	r, err := c.request(m, st, steps, []byte{0, 0x3c, 0x3d, 0x3e}[i%4])
	r.Spec.Prompt = fmt.Sprintf("%s, member %d", r.Spec.Prompt, i)
	r.Spec.Seed += int64(i)
	return r, err
}

// runBatch runs rs at once, each under its context, and returns each
// one's error.
func (c *checker) runBatch(rs []Request, ctxs []context.Context) []error {
	errs := make([]error, len(rs))
	var wg sync.WaitGroup
	for i := range rs {
		wg.Go(func() {
			tctx, cancel := context.WithTimeout(ctxs[i], c.cfg.TaskTimeout)
			defer cancel()
			errs[i] = c.srv.Run(tctx, rs[i])
		})
	}
	wg.Wait()
	return errs
}

func (c *checker) batchCheck(ctx context.Context, m Model, st string, max int) CheckResult {
	name := fmt.Sprintf("batch %s %s", st, m.Name)
	n := min(max, 4)
	lone := make([][]byte, n)
	for i := range n {
		r, err := c.batchMember(m, st, taskSteps, i)
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}
		}
		if errs := c.runBatch([]Request{r}, []context.Context{ctx}); errs[0] != nil {
			return CheckResult{Name: name, Detail: fmt.Sprintf("member %d run alone: %s", i, c.ranOrGone(errs[0]))}
		}
		lone[i] = append([]byte(nil), r.Output.Data...)
	}
	rs := make([]Request, n)
	ctxs := make([]context.Context, n)
	for i := range n {
		r, err := c.batchMember(m, st, taskSteps, i)
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}
		}
		rs[i], ctxs[i] = r, ctx
	}
	calls := c.srv.Calls(st)
	start := time.Now()
	for i, err := range c.runBatch(rs, ctxs) {
		if err != nil {
			return CheckResult{Name: name, Detail: fmt.Sprintf("member %d of a batch of %d: %s", i, n, c.ranOrGone(err))}
		}
	}
	took := time.Since(start).Round(time.Millisecond)
	if made := c.srv.Calls(st) - calls; made != 1 {
		return CheckResult{Name: name, Inconclusive: true, Detail: fmt.Sprintf("the %d tasks went in %d calls, not one batch (they reached the agent side more than its batch window apart)", n, made)}
	}
	for i, r := range rs {
		if why := near(r.Output.DType, r.Output.Data, lone[i]); why != "" {
			return CheckResult{Name: name, Detail: fmt.Sprintf("member %d of a batch of %d wrote an output that is not its own (the same task run alone): %s; each member's rows must be computed as alone", i, n, why)}
		}
	}
	detail := fmt.Sprintf("%d tasks in one call (%v), each the output of its task run alone", n, took)
	if st == StageDenoise {
		why, inconclusive := c.batchCancel(ctx, m, n)
		switch {
		case inconclusive:
			return CheckResult{Name: name, Inconclusive: true, Detail: detail + "; " + why}
		case why != "":
			return CheckResult{Name: name, Detail: detail + "; but " + why}
		}
		detail += "; a member cancelled mid-denoise stopped alone, the others finished"
	}
	return CheckResult{Name: name, Pass: true, Detail: detail}
}

// batchCancel runs a denoise batch of n whose member 1 is cancelled after
// its first step: it must end cancelled and the others done. It returns
// what went wrong ("" for nothing), or, inconclusive, that member 1 ended
// before the cancel could reach it.
func (c *checker) batchCancel(ctx context.Context, m Model, n int) (why string, inconclusive bool) {
	steps := min(c.cfg.Steps, stepLimit(m)) // as the cancel check's, so that a step-paced engine is still running
	rs := make([]Request, n)
	ctxs := make([]context.Context, n)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range n {
		r, err := c.batchMember(m, StageDenoise, steps, i)
		if err != nil {
			return err.Error(), false
		}
		rs[i], ctxs[i] = r, ctx
	}
	ctxs[1] = cctx
	rs[1].Progress = func(step, _ int) {
		if step >= 1 {
			cancel()
		}
	}
	errs := c.runBatch(rs, ctxs)
	for i, err := range errs {
		switch {
		case i == 1 && err == nil:
			return fmt.Sprintf("member 1 of %d cancelled after its first step ended done: its %d steps ran before the cancel reached the engine, so the check cannot tell whether a member stops alone (give the check slower steps, as the torch worker's --step-ms)", n, steps), true
		case i == 1 && !errors.Is(err, context.Canceled):
			return fmt.Sprintf("member 1, cancelled, ended with %v", err), false
		case i != 1 && err != nil:
			return fmt.Sprintf("member %d failed when member 1 was cancelled: %s", i, c.ranOrGone(err)), false
		}
	}
	return "", false
}

// near reports how got differs from want beyond a rounding ("" when it
// does not): a byte of a uint8 tensor off by one, a float32 value off by a
// thousandth of the tensor's largest; any difference in other dtypes.
func near(dtype string, got, want []byte) string {
	if len(got) != len(want) {
		return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
	}
	switch dtype {
	case "uint8":
		for i := range got {
			if d := int(got[i]) - int(want[i]); d > 1 || d < -1 {
				return fmt.Sprintf("byte %d is %d, alone %d", i, got[i], want[i])
			}
		}
		return ""
	case "float32":
		scale := 1.0
		for i := 0; i+4 <= len(want); i += 4 {
			scale = math.Max(scale, math.Abs(float64(math.Float32frombits(binary.LittleEndian.Uint32(want[i:])))))
		}
		for i := 0; i+4 <= len(got); i += 4 {
			g := float64(math.Float32frombits(binary.LittleEndian.Uint32(got[i:])))
			w := float64(math.Float32frombits(binary.LittleEndian.Uint32(want[i:])))
			if math.Abs(g-w) > 1e-3*scale || math.IsNaN(g) != math.IsNaN(w) {
				return fmt.Sprintf("value %d is %g, alone %g", i/4, g, w)
			}
		}
		return ""
	}
	return differ(got, want)
}
