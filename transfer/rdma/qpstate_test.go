package rdma

import (
	"errors"
	"testing"
)

func TestCanMoveTo(t *testing.T) {
	states := []QPState{StateReset, StateInit, StateRTR, StateRTS, StateError}
	legal := map[[2]QPState]bool{
		{StateReset, StateInit}: true,
		{StateInit, StateRTR}:   true,
		{StateRTR, StateRTS}:    true,
	}
	for _, from := range states {
		for _, to := range states {
			want := legal[[2]QPState{from, to}] || to == StateReset || to == StateError
			if got := from.CanMoveTo(to); got != want {
				t.Errorf("%v -> %v: %v, want %v", from, to, got, want)
			}
		}
	}
	if StateRTS.CanMoveTo(QPState(4)) {
		t.Error("RTS -> SQD allowed")
	}
	if QPState(4).String() != "QPState(4)" || StateRTR.String() != "RTR" {
		t.Error("String")
	}
}

func TestTransitions(t *testing.T) {
	cfg := DefaultConfig()
	local := QPInfo{LID: 1, QPN: 0x11, PSN: 0x111, GID: [16]byte{1}, MTU: 5, Port: 1}
	remote := QPInfo{LID: 2, QPN: 0x22, PSN: 0x222, GID: [16]byte{2}, MTU: 3, Port: 2}
	ts, err := Transitions(cfg, local, remote)
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 3 {
		t.Fatalf("%d transitions", len(ts))
	}
	from := StateReset
	for _, tr := range ts {
		if tr.From != from || !tr.From.CanMoveTo(tr.To) || tr.Attrs.State != tr.To {
			t.Fatalf("transition %v -> %v (attr state %v) after %v", tr.From, tr.To, tr.Attrs.State, from)
		}
		if req, ok := RequiredMask(tr.From, tr.To); !ok || tr.Mask&req != req {
			t.Fatalf("%v -> %v mask %#x lacks required %#x", tr.From, tr.To, tr.Mask, req)
		}
		from = tr.To
	}
	init, rtr, rts := ts[0].Attrs, ts[1].Attrs, ts[2].Attrs
	if init.Port != 1 || init.AccessFlags != AccessRemoteRead {
		t.Errorf("INIT %+v", init)
	}
	av := rtr.AV
	if rtr.DestQPN != 0x22 || rtr.RQPSN != 0x222 || rtr.PathMTU != 3 || rtr.MaxDestRdAtomic != 16 ||
		rtr.MinRNRTimer != cfg.MinRNRTimer {
		t.Errorf("RTR %+v", rtr)
	}
	if !av.Global || av.DGID != remote.GID || av.DLID != 2 || av.Port != 1 || av.HopLimit == 0 || av.SGIDIndex != 0 {
		t.Errorf("RTR address vector %+v", av)
	}
	if rts.SQPSN != 0x111 || rts.Timeout != cfg.Timeout || rts.RetryCnt != cfg.RetryCount ||
		rts.RNRRetry != cfg.RNRRetry || rts.MaxRdAtomic != 16 {
		t.Errorf("RTS %+v", rts)
	}
}

func TestTransitionsAddressing(t *testing.T) {
	local := QPInfo{LID: 1, QPN: 1, MTU: 5, Port: 1}
	ibPeer := QPInfo{LID: 9, QPN: 2, MTU: 5, Port: 1}
	rocePeer := QPInfo{QPN: 2, GID: [16]byte{0xfe, 0x80}, MTU: 3, Port: 1}

	lidOnly := DefaultConfig()
	lidOnly.GIDIndex = -1
	lidOnly.MTU = 2048
	ts, err := Transitions(lidOnly, local, ibPeer)
	if err != nil {
		t.Fatal(err)
	}
	if av := ts[1].Attrs.AV; av.Global || av.DLID != 9 || ts[1].Attrs.PathMTU != 4 {
		t.Fatalf("lid-only RTR %+v", ts[1].Attrs)
	}
	if _, err := Transitions(lidOnly, local, rocePeer); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("lid-only config with a RoCE peer: %v", err)
	}
	ts, err = Transitions(DefaultConfig(), local, rocePeer)
	if err != nil || !ts[1].Attrs.AV.Global {
		t.Fatalf("RoCE peer: %v %+v", err, ts)
	}
	if _, err := Transitions(DefaultConfig(), local, QPInfo{}); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("zero remote: %v", err)
	}
	if _, err := Transitions(DefaultConfig(), QPInfo{}, ibPeer); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("zero local: %v", err)
	}
}

func TestErrorTransition(t *testing.T) {
	tr := errorTransition(StateRTS)
	if req, _ := RequiredMask(StateRTS, StateError); tr.Mask != req || tr.To != StateError || tr.Attrs.State != StateError {
		t.Fatalf("%+v", tr)
	}
	if _, ok := RequiredMask(StateRTS, StateInit); ok {
		t.Fatal("RTS -> INIT has a mask")
	}
}
