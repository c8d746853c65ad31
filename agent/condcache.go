package agent

// This file is the conditioning cache (issue 19): what an encoder made of a
// text, kept as a content-addressed Store entry (cache.Store.Memo) that any
// agent finds by computing its id. A submission whose prompt and negative
// prompt are both cached gets no encode task at all: its denoise reads the
// entries from their holder. An encode that runs takes each half it finds
// from the cache and encodes only the rest, publishing what it encoded as
// new entries, so concurrent jobs with one new negative prompt encode it
// once in the whole mesh.
//
// Entries are keyed by the model, the encoder's version and the text, so a
// new encoder version never reads an old one's entries (and this agent
// drops the ones it holds when its engine's version changes); they live in
// each holder's cache room (Config.CondCacheBytes), least recently used
// evicted first. An engine that encodes both texts as one tensor (external
// engines, protocol v1) is cached whole, by the pair of texts.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/transfer"
)

// condVersioned is a StageRunner that can name the version of a model's
// encoder: what it made of a text can then be cached, whole.
type condVersioned interface {
	// EncoderVersion names model's encoder and every setting that changes
	// its output ("" when this runner does not encode model).
	EncoderVersion(model string) string
}

// textEncoder is a StageRunner whose conditioning is the prompt's
// encoding followed by the negative prompt's, each made alone: the cache
// keeps the two texts apart, so a shared negative prompt is encoded once
// whatever the prompts.
type textEncoder interface {
	condVersioned
	// BranchMeta is the meta of one text's half of s's conditioning.
	BranchMeta(s engine.Spec) (transfer.TensorMeta, error)
	// EncodeText writes one text's half of s's conditioning into dst.
	EncodeText(ctx context.Context, s engine.Spec, text string, dst []byte) error
}

// Cache hits and misses are counted by what the entry holds.
const (
	condPrompt   = "prompt"
	condNegative = "negative"
	condWhole    = "conditioning" // both texts, as one tensor
)

// condPrefix opens every conditioning entry's object id.
const condPrefix = "cond."

// condVersionTag is the part of an entry's id that names model's encoder
// version: 8 hex digits of their hash.
func condVersionTag(model, version string) string {
	h := sha256.Sum256([]byte(model + "\x00" + version))
	return hex.EncodeToString(h[:4])
}

// condID names the entry of what model's encoder version made of texts:
// "cond.<version tag>.t.<hash>" for one text, "cond.<tag>.w.<hash>" for a
// prompt and negative prompt encoded together.
func condID(model, version string, texts ...string) string {
	kind := "t"
	if len(texts) > 1 {
		kind = "w"
	}
	h := sha256.New()
	for _, s := range append([]string{model, version, kind}, texts...) {
		fmt.Fprintf(h, "%d:%s", len(s), s) // length-prefixed: no two lists hash alike
	}
	return condPrefix + condVersionTag(model, version) + "." + kind + "." + hex.EncodeToString(h.Sum(nil)[:16])
}

// condEntry is one part of a job's conditioning: which entry holds it,
// what it is counted as, and its text(s).
type condEntry struct {
	id    string
	kind  string // condPrompt, condNegative or condWhole
	texts []string
}

// condEntries lists the entries s's conditioning is made of for an
// encoder of version, in the conditioning's order; split says the encoder
// makes each text alone (textEncoder).
func condEntries(s engine.Spec, version string, split bool) []condEntry {
	model := s.ModelName()
	if extra := condExtras(s); !split || len(extra) > 0 {
		key := append([]string{s.Prompt, s.NegativePrompt}, extra...)
		return []condEntry{{id: condID(model, version, key...), kind: condWhole, texts: []string{s.Prompt, s.NegativePrompt}}}
	}
	return []condEntry{
		{id: condID(model, version, s.Prompt), kind: condPrompt, texts: []string{s.Prompt}},
		{id: condID(model, version, s.NegativePrompt), kind: condNegative, texts: []string{s.NegativePrompt}},
	}
}

// condExtras is what an encode may see of s beyond its texts (protocol
// v2: the model's parameters and the reference image), which an entry's
// key must name too; such conditioning is cached whole.
func condExtras(s engine.Spec) []string {
	var out []string
	if len(s.Params) > 0 {
		out = append(out, "params:"+engine.CanonicalParams(s.Params))
	}
	if s.Image != nil {
		out = append(out, "image:"+s.Image.SHA256)
	}
	return out
}

// condCaching reports whether this agent caches conditioning.
func (a *Agent) condCaching() bool { return a.cfg.CondCacheBytes > 0 }

// cachedCond is the conditioning of s if the cache holds all of it, as
// the denoise task's inputs (Options.Cond): the entries of the encoder
// version the live encoders of s's model register, found by the Store
// (cache.Store.Entry: an etcd read under ctx for an entry held elsewhere,
// at most one per EntryTTL). While they disagree (a rolling upgrade) nothing is
// looked up here: the encoder that runs the task looks up its own
// version's. It counts the lookups that hit; a miss is counted where the
// encode runs.
func (a *Agent) cachedCond(ctx context.Context, s engine.Spec) []jobs.Input {
	if !a.condCaching() {
		return nil
	}
	encs := a.encoders(s.ModelName())
	if len(encs) != 1 {
		return nil
	}
	var ins []jobs.Input
	entries := condEntries(s, encs[0].Encoder, encs[0].SplitCond)
	for _, e := range entries {
		rec, ok := a.cstore.Entry(ctx, e.id)
		if !ok {
			return nil
		}
		ins = append(ins, a.entryInput(rec))
	}
	for _, e := range entries {
		a.metrics.CondLookup(e.kind, true)
	}
	return ins
}

// entryInput is the input of a task that reads entry rec: from this node
// when it holds a copy, whose ref it names so that the worker the task is
// pushed to can be issued a ticket for it (issueTickets).
func (a *Agent) entryInput(rec cache.Record) jobs.Input {
	in := jobs.Input{Payload: rec.ID, Node: rec.Holders[0].Node, Store: true, Cached: true}
	for _, h := range rec.Holders {
		if h.Node == a.id {
			if raw, err := json.Marshal(h.Ref); err == nil {
				in.Node, in.Ref = a.id, raw
			}
		}
	}
	return in
}

// encoderOf is a version of a model's encoder, as node records name it.
type encoderOf struct {
	Encoder   string
	SplitCond bool
}

// encoders lists the encoder versions the live agents serving model's
// encode registered (modelRecord.Encoder), most common first.
func (a *Agent) encoders(model string) []encoderOf {
	count := map[encoderOf]int{}
	for _, p := range a.member.Peers() {
		raw, has := p.Record.Models[model]
		if !p.Alive || !has || !p.Record.HasRole(gossip.RoleEncode) {
			continue
		}
		var rec modelRecord
		if err := json.Unmarshal(raw, &rec); err != nil || rec.Encoder == "" {
			continue
		}
		count[encoderOf{Encoder: rec.Encoder, SplitCond: rec.SplitCond}]++
	}
	out := make([]encoderOf, 0, len(count))
	for r := range count {
		out = append(out, r)
	}
	slices.SortFunc(out, func(x, y encoderOf) int {
		if d := count[y] - count[x]; d != 0 {
			return d
		}
		return strings.Compare(x.Encoder, y.Encoder)
	})
	return out
}

// encodeCached runs c's encode through the conditioning cache: each entry
// of its conditioning is found, or made here (by this task, or by one
// running here or elsewhere on the same text) and published as a new
// entry. ok is false when this agent cannot cache c's conditioning (the
// cache is off, the runner names no encoder version, an entry does not
// fit the cache's room, or the job was rewound): the caller encodes as
// before.
//
// A rewound job lost an input, and the likeliest input to lose is a cache
// entry: one evicted from its holder's room (or gone with it) while the
// job waited for its denoise, which a queue longer than the room's entries
// makes likely. Its encode therefore makes a plain payload, which lives
// until the denoise releases it: found again in the cache, the entry
// could go again the same way, until the job failed (MaxRewinds).
func (a *Agent) encodeCached(ctx context.Context, c *jobs.Claim) (out jobs.Output, ok bool, err error) {
	if !a.condCaching() || c.Task.Rewinds > 0 {
		return out, false, nil
	}
	s := c.Task.Spec
	cv, versioned := a.runner.(condVersioned)
	if !versioned {
		return out, false, nil
	}
	version := cv.EncoderVersion(s.ModelName())
	if version == "" {
		return out, false, nil
	}
	whole, err := a.runner.CondMeta(s)
	if err != nil {
		return out, true, err
	}
	te, split := a.runner.(textEncoder)
	var half transfer.TensorMeta
	if split {
		// Halves only where they make the whole: else it is cached whole.
		half, err = te.BranchMeta(s)
		split = err == nil && 2*half.Bytes() == whole.Bytes() && len(condExtras(s)) == 0
	}
	var hits []string
	for _, e := range condEntries(s, version, split) {
		produce := func(ctx context.Context) ([]byte, transfer.TensorMeta, error) {
			if split {
				dst := make([]byte, half.Bytes())
				return dst, half, te.EncodeText(ctx, s, e.texts[0], dst)
			}
			dst := make([]byte, whole.Bytes())
			return dst, whole, a.runner.Encode(ctx, s, dst)
		}
		rec, hit, err := a.cstore.Memo(ctx, cache.MemoSpec{ID: e.id, Lease: c.Lease}, produce)
		if errors.Is(err, cache.ErrFull) {
			a.log.Debug("conditioning entry does not fit the cache; encoding without it", zap.String("job", c.Task.JobID), zap.Error(err))
			return out, false, nil
		}
		if err != nil {
			if errors.Is(err, engine.ErrBadSpec) || ctx.Err() != nil {
				return out, true, err
			}
			return out, true, fmt.Errorf("%w: conditioning cache: %v", errTransient, err)
		}
		a.metrics.CondLookup(e.kind, hit)
		if hit {
			hits = append(hits, e.kind)
		}
		out.Payloads = append(out.Payloads, a.entryInput(rec))
	}
	out.CacheHits = hits
	out.Hint = a.pickHint(jobs.Denoise, s)
	return out, true, nil
}

// pullCond pulls a denoise's conditioning made of cache entries (more than
// one: a prompt's and a negative prompt's, each a part of the whole in
// order) into one buffer. A part whose every holder fails is dropped from
// the cache, so that the job's rewind encodes it again rather than find it.
func (a *Agent) pullCond(ctx context.Context, s engine.Spec, ins []jobs.Input) (engine.Tensor, func(), error) {
	defer addPullTime(ctx, time.Now())
	meta, err := a.runner.CondMeta(s)
	if err != nil {
		return engine.Tensor{}, nil, err
	}
	dst, release := a.buffer(meta.Bytes())
	at := int64(0)
	for _, in := range ins {
		_, refs, err := a.inputRefs(ctx, []jobs.Input{in})
		if err == nil {
			n := refs[0].Meta.Bytes()
			if at+n > int64(len(dst)) {
				err = fmt.Errorf("%w: conditioning parts of more than %d bytes", errInputLost, len(dst))
			} else {
				err = a.pullFrom(ctx, in, refs, dst[at:at+n])
				at += n
			}
		}
		if err != nil {
			release()
			return engine.Tensor{}, nil, err
		}
	}
	if at != int64(len(dst)) {
		release()
		return engine.Tensor{}, nil, fmt.Errorf("%w: conditioning parts of %d bytes, the model's is %d", errInputLost, at, len(dst))
	}
	return engine.Tensor{Meta: meta, Data: dst}, release, nil
}

// dropEntry deletes a cache entry no holder could serve.
func (a *Agent) dropEntry(id string) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	if err := a.cstore.Delete(ctx, id); err != nil {
		a.log.Debug("dropping an unreadable cache entry", zap.String("object", id), zap.Error(err))
	}
}

// dropStaleCond deletes the conditioning entries this agent holds that its
// encoders' current versions no longer ask for (an engine registered a new
// version): invalidation, beyond the keys that already never meet.
func (a *Agent) dropStaleCond() {
	cv, ok := a.runner.(condVersioned)
	if !ok || !a.condCaching() {
		return
	}
	keep := map[string]bool{}
	for model := range a.runner.Models() {
		if v := cv.EncoderVersion(model); v != "" {
			keep[condVersionTag(model, v)] = true
		}
	}
	if len(keep) == 0 {
		return // no engine registered now: nothing says a version changed
	}
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	n, err := a.cstore.DropEntries(ctx, condPrefix, func(id string) bool {
		tag, _, _ := strings.Cut(strings.TrimPrefix(id, condPrefix), ".")
		return keep[tag]
	})
	if n > 0 || err != nil {
		a.log.Info("conditioning entries of an old encoder version dropped", zap.Int("entries", n), zap.Error(err))
	}
	a.metrics.CondDropped(n)
}
