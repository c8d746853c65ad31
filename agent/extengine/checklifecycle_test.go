package extengine

import (
	"encoding/binary"
	"fmt"
	"math"
	"regexp"
	"slices"
	"testing"
	"time"
)

// fakeAdapter is the adapter a lifecycle fake loads after its welcome.
const fakeAdapter = "paint-v1"

// lifecycleFaults break one lifecycle behaviour each. With lifecycle set
// the fake's model decodes like a causal VAE (each latent frame's pixels
// depend on the frames before it in its stream), reports chunk 0 of a
// denoise of several latent frames ready after half its steps, and loads
// fakeAdapter after the welcome.
type lifecycleFaults struct {
	lifecycle bool
	// chunkPastEnd reports chunk `frames` ready (out of the latent);
	// chunkTwice reports chunk 0 ready twice; rewriteReady writes chunk 0
	// again at the end, after reporting it ready.
	chunkPastEnd, chunkTwice, rewriteReady bool
	// badAdapter is loaded instead of fakeAdapter (a malformed name);
	// adapterOnTask loads it when the first task arrives rather than
	// after the welcome.
	badAdapter    string
	adapterOnTask bool
	// stateless decodes every chunk from a fresh state; noLostState
	// decodes a chunk of a stream it holds no state of from a fresh state
	// (rather than failing lost_state); keepAfterEnd ignores stream_end.
	stateless, noLostState, keepAfterEnd bool
}

// welcomed checks the lifecycle features were granted and loads the
// fake's adapter (the agent's ack arrives on the reader loop).
func (s *fakeSession) welcomed(w *Msg) error {
	for _, f := range []string{FeatureDecodeState, FeatureChunkReady, FeatureAdapters} {
		if w.Version != Version2 || !slices.Contains(w.Features, f) {
			return fmt.Errorf("welcome chose version %d, features %v; want 2 with %s", w.Version, w.Features, f)
		}
	}
	if s.f.adapterOnTask {
		return nil
	}
	return s.loadAdapter()
}

// loadAdapter says the fake's adapter is loaded.
func (s *fakeSession) loadAdapter() error {
	name := fakeAdapter
	if s.f.badAdapter != "" {
		name = s.f.badAdapter
	}
	return s.send(&Msg{T: TypeAdapterLoaded, Model: "fake", Adapter: name})
}

// adapterTaken says whether the agent acked the adapter the fake loaded
// (a malformed one is never acked: the connection ends for it).
func (s *fakeSession) adapterTaken() error {
	if s.f.badAdapter != "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.lacks) != 1 || s.lacks[0].Adapter != fakeAdapter || s.lacks[0].Reason != "" {
		return fmt.Errorf("acks of adapter_loaded %s: %+v, want one taking it", fakeAdapter, s.lacks)
	}
	return nil
}

// readyChunks, after step of a denoise of several latent frames, writes
// chunk 0 at step total/2 and reports it ready: its values are final from
// then on. It returns how many of x's leading values are final (written).
func (s *fakeSession) readyChunks(m *Msg, step int32, x []float32, out []byte, final int) int {
	f := s.f.lifecycleFaults
	frames := int(m.Output.Shape[0])
	if !f.lifecycle || frames < 2 || step != int32(m.Spec.Steps)/2 {
		return final
	}
	n := len(x) / frames
	for i := range n {
		binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(x[i]))
	}
	chunk := int32(0)
	if f.chunkPastEnd {
		chunk = int32(frames)
	}
	s.send(&Msg{T: TypeChunkReady, Task: m.Task, Chunk: chunk})
	if f.chunkTwice {
		s.send(&Msg{T: TypeChunkReady, Task: m.Task, Chunk: chunk})
	}
	if f.rewriteReady {
		return final // written again with the rest at the end
	}
	return n
}

// decodeCausal decodes latent frames like a causal VAE: the state is a
// running sum of the frames so far, carried from chunk to chunk of a
// stream, and each frame's pixels are a function of it.
func (s *fakeSession) decodeCausal(m *Msg, in, out []byte) *Msg {
	f := s.f.lifecycleFaults
	fb, pix := len(in)/int(m.Frames), len(out)/int(m.Frames)
	var acc []byte
	if m.Stream != 0 && m.Chunk > 0 && !f.stateless {
		s.mu.Lock()
		st, ok := s.streams[m.Stream]
		s.mu.Unlock()
		if !ok && !f.noLostState {
			return &Msg{T: TypeFailed, Task: m.Task, Code: CodeLostState, Reason: fmt.Sprintf("no state of stream %d", m.Stream)}
		}
		acc = st
	}
	if acc == nil {
		acc = make([]byte, fb)
	}
	for j := range int(m.Frames) {
		for i := range acc {
			acc[i] += in[j*fb+i]
		}
		for p := range pix {
			out[j*pix+p] = acc[p%fb] ^ byte(p/fb)
		}
	}
	if m.Stream != 0 {
		s.mu.Lock()
		if m.Last {
			delete(s.streams, m.Stream)
		} else {
			s.streams[m.Stream] = acc
		}
		s.mu.Unlock()
	}
	return &Msg{T: TypeDone, Task: m.Task}
}

// Each broken lifecycle behaviour fails its check with a line saying what
// the engine did, and a correct engine passes. Faults in different checks
// share a run (each run costs a second of heartbeat and cancel checks):
// the other checks of a run must pass.
func TestCheckLifecycle(t *testing.T) {
	const (
		decodeStream = "decode stream"
		chunkReady   = "chunk ready"
		frames       = "protocol frames"
		closed       = "the agent closed the connection for a frame of the engine's: extengine: bad frame: "
	)
	for _, tc := range []struct {
		name string
		f    lifecycleFaults
		// want are the lines of the checks the faults fail (regular
		// expressions of the whole detail); every other check passes.
		want map[string]string
		// skipRest: the connection ended early, so checks after the
		// fault fail or skip as well (the named ones as said).
		skipRest bool
	}{
		{name: "correct", want: map[string]string{
			decodeStream: `^3 latent frames as a stream's chunks, interleaved with another stream, give the whole decode's bytes; a chunk without its state \(chunk 0 never sent, or after stream_end\) is answered lost_state$`,
			chunkReady:   `^chunks \[0\] of 2 reported ready before the last step, unchanged after$`,
			frames:       `^every frame the engine sent was well-formed$`,
		}},
		{name: "stateless decode, chunk rewritten after ready", f: lifecycleFaults{stateless: true, rewriteReady: true}, want: map[string]string{
			decodeStream: `^latent frames \[0,3\) decoded as the chunks of one stream \(another stream's chunks between them\) differ from the same frames decoded whole: 32592 of 49152 bytes differ \(first at byte 16387\); the engine must carry each stream's state from chunk to chunk, and keep streams apart$`,
			chunkReady:   `^chunk 0 was reported ready after step 2, but changed afterwards: 815 of 1024 bytes differ \(first at byte 0\); a chunk reported ready must not be written again$`,
		}},
		{name: "decodes without state, chunk past the latent", f: lifecycleFaults{noLostState: true, chunkPastEnd: true}, want: map[string]string{
			decodeStream: `^chunk 1 of a stream whose chunk 0 never came: the engine answered done; it must answer failed \{code: lost_state\} \(it decoded without the state of chunk 0\)$`,
			chunkReady:   `^a 2-frame denoise: ` + closed + `chunk_ready of chunk 2 of task \d+, whose latent has 2 chunks$`,
			frames:       `^` + closed + `chunk_ready of chunk 2 of task \d+, whose latent has 2 chunks$`,
		}},
		{name: "keeps state after stream_end, chunk ready twice", f: lifecycleFaults{keepAfterEnd: true, chunkTwice: true}, want: map[string]string{
			decodeStream: `^chunk 1 of a stream after its stream_end: the engine answered done; it must answer failed \{code: lost_state\} \(it decoded without the state of chunk 0\)$`,
			chunkReady:   `^a 2-frame denoise: ` + closed + `chunk_ready of chunk 0 of task \d+ twice$`,
			frames:       `^` + closed + `chunk_ready of chunk 0 of task \d+ twice$`,
		}},
		{name: "adapter name out of bounds", f: lifecycleFaults{badAdapter: "paint-v1-with-a-name-of-33-bytes_", adapterOnTask: true}, skipRest: true, want: map[string]string{
			"task denoise fake": `^` + closed + `adapter_loaded: adapter: must be 1-32 bytes$`,
			frames:              `^` + closed + `adapter_loaded: adapter: must be 1-32 bytes$`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.f.lifecycle = true
			res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 10 * time.Millisecond, lifecycleFaults: tc.f})
			for name, want := range tc.want {
				r := result(t, res, name)
				if r.Failed() == (tc.name == "correct") || !regexp.MustCompile(want).MatchString(r.Detail) {
					t.Errorf("%s: %s\nwant it to match %s", tc.name, r, want)
				}
			}
			if ok != (tc.name == "correct") {
				t.Errorf("%s: the check passed: %v\n%s", tc.name, ok, out)
			}
			for _, r := range res {
				if _, named := tc.want[r.Name]; !named && !tc.skipRest && r.Failed() {
					t.Errorf("%s fails another check too: %s", tc.name, r)
				}
			}
		})
	}
}

// An engine whose connection the agent closes for a frame sent right
// after the welcome (before the check can begin) fails at once, the line
// naming the frame: the register line when the check had not yet seen
// the registration, else the protocol frames line; never a wait for a
// registration that came and went.
func TestCheckLifecycleFrameBeforeCheck(t *testing.T) {
	const why = `the agent closed the connection for a frame of the engine's: extengine: bad frame: adapter_loaded: adapter: "a/b": only letters, digits and . _ - are allowed`
	start := time.Now()
	res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 10 * time.Millisecond, lifecycleFaults: lifecycleFaults{lifecycle: true, badAdapter: "a/b"}})
	if ok {
		t.Fatalf("an engine sending a malformed adapter_loaded passes:\n%s", out)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("the check took %v: it waited for a registration that had ended", took)
	}
	if reg := result(t, res, "register"); reg.Failed() {
		if want := "the engine registered, but before the check began " + why; reg.Detail != want {
			t.Errorf("register line %q, want %q", reg.Detail, want)
		}
		return
	}
	if r := result(t, res, "protocol frames"); !r.Failed() || r.Detail != why {
		t.Errorf("protocol frames: %s, want a failure %q", r, why)
	}
}
