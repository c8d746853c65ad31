package agent

import (
	"context"
	"errors"
	"testing"
)

func TestYielderAsksOnce(t *testing.T) {
	y := newYielder()
	if y.why() != nil {
		t.Fatal("a fresh yielder has a cause")
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	if !y.ask(errPreempted, cancel, ctx.Done()) {
		t.Fatal("the first ask did not ask")
	}
	select {
	case <-y.stop:
	default:
		t.Fatal("ask did not close the stop channel")
	}
	if y.ask(errDrained, cancel, ctx.Done()) {
		t.Fatal("a second ask asked again (a preemption would be counted twice)")
	}
	if !errors.Is(y.why(), errPreempted) {
		t.Fatalf("cause %v, want the first ask's", y.why())
	}
	if ctx.Err() != nil {
		t.Fatal("asking cancelled the task instead of letting it stop at a checkpoint")
	}
	var none *yielder
	if none.why() != nil {
		t.Fatal("a nil yielder has a cause")
	}
}
