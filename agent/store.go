package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/transfer"
)

// storeMembers lists the live members as the Store sees them: registered in
// etcd and alive in gossip, with the Store room each gossips (this node's
// own room exactly).
func (a *Agent) storeMembers() []cache.Member {
	var out []cache.Member
	for _, p := range a.member.Peers() {
		if !p.Registered || !p.Alive || p.Record.PeerID == "" {
			continue
		}
		m := cache.Member{
			Node: p.Record.ID, PeerID: p.Record.PeerID, P2PAddrs: p.Record.P2PAddrs,
			Host: p.Record.Host, Free: int64(p.Meta.StoreFree), Suspect: p.Suspect,
		}
		if m.Node == a.id {
			m.Free = a.cstore.Room()
		}
		out = append(out, m)
	}
	return out
}

// storeRoom is the Store room the live members gossip: in all, and the
// largest object one of them can take.
func (a *Agent) storeRoom() (total, largest int64) {
	for _, m := range a.storeMembers() {
		total += m.Free
		largest = max(largest, m.Free)
	}
	return total, largest
}

// registeredNodes reads the node ids registered in etcd now, for the
// Store's collector (cache.Config.Registered).
func (a *Agent) registeredNodes(ctx context.Context) (map[string]bool, error) {
	prefix := a.cfg.Prefix + "/nodes/"
	resp, err := a.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), prefix)] = true
	}
	return out, nil
}

// orphans names the Store objects whose job will never use them: the job is
// gone (deleted, or its record expired), failed or cancelled, or it
// succeeded and the object was a relayed latent nobody consumed or a frame
// preview. The decode's commit deletes the previews it knows of, but a
// preview put by an attempt that lost its claim (paused, partitioned) can
// land after that commit; nothing else would remove it before its TTL.
func (a *Agent) orphans(ctx context.Context, recs []cache.Record) ([]string, error) {
	ids := map[string]bool{}
	for _, r := range recs {
		if r.Job != "" {
			ids[r.Job] = true
		}
	}
	list := make([]string, 0, len(ids))
	for id := range ids {
		list = append(list, id)
	}
	states, err := a.store.States(ctx, list)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, r := range recs {
		if r.Job == "" {
			continue
		}
		st, ok := states[r.Job]
		switch {
		case !ok, st == jobs.Failed, st == jobs.Cancelled:
			out = append(out, r.ID)
		case st == jobs.Succeeded && (r.Mode == cache.Consume || jobs.IsPreview(r.Job, r.ID)):
			out = append(out, r.ID)
		}
	}
	return out, nil
}

// transferMode is the mode for task t's outputs: the job's, else ours.
func (a *Agent) transferMode(t jobs.Task) jobs.TransferMode {
	if t.Transfer != "" {
		return t.Transfer
	}
	return a.cfg.TransferMode
}

// handoff decides how the output of t (size bytes), already in this
// node's arena, reaches the next stage, whose preferred worker is hint (""
// when none has credit). "Room" is room for one more output of its size:
// auto keeps a payload here for its consumer only while holding it does not
// starve this node's next task.
func (a *Agent) handoff(t jobs.Task, hint string, size int64) routing.Handoff {
	room := true
	if st := a.xfer.Stats(); st.HasArena {
		room = st.Arena.LargestFree >= size // one block, as the next Begin needs
	}
	return routing.ChooseHandoff(string(a.transferMode(t)), hint != "", room)
}

// relay puts a produced payload into the Store as a delete-on-consume
// object and frees the producer's buffer at once: the next stage reads a
// replica, and a producer that dies after this costs nothing. The object's
// record is written by the stage's commit (out.Records).
func (a *Agent) relay(ctx context.Context, c *jobs.Claim, ref transfer.Ref, hint string) (jobs.Output, *cache.Staged, error) {
	id := cache.JobObjectID(c.Task.JobID, string(c.Task.Stage)+"."+ref.ID)
	st, err := a.cstore.Stage(ctx, cache.PutSpec{ID: id, Mode: cache.Consume, Job: c.Task.JobID}, ref)
	if err != nil {
		return jobs.Output{}, nil, err
	}
	a.release(ref.ID)
	a.relayed.Add(1)
	out := jobs.Output{
		Payloads: []jobs.Input{{Payload: id, Node: a.id, Store: true}},
		Hint:     hint,
		Records:  []jobs.StagedRecord{st},
	}
	return out, st, nil
}

// inputRefs resolves a task's single input to the references to pull it
// from, nearest first: the producer's payload, or the Store object's holders.
func (a *Agent) inputRefs(ctx context.Context, ins []jobs.Input) (jobs.Input, []transfer.Ref, error) {
	if len(ins) != 1 {
		return jobs.Input{}, nil, fmt.Errorf("%w: task has %d inputs, want 1", errInputLost, len(ins))
	}
	in := ins[0]
	if !in.Store {
		_, ref, err := input(ins)
		if err == nil {
			err = a.checkProducer(in, ref)
		}
		return in, []transfer.Ref{ref}, err
	}
	var rec cache.Record
	found := false
	if in.Cached {
		rec, found = a.cstore.Entry(ctx, in.Payload) // read at most once per EntryTTL
	}
	var err error
	if !found {
		rec, err = a.cstore.Lookup(ctx, in.Payload)
	}
	if errors.Is(err, cache.ErrNotFound) {
		return in, nil, fmt.Errorf("%w: store object %s: %v", errInputLost, in.Payload, err)
	}
	if err != nil {
		return in, nil, fmt.Errorf("%w: look up %s: %v", errTransient, in.Payload, err)
	}
	var refs []transfer.Ref
	// Nearest leaves out holders that are not their node's registered peer
	// (registeredAs, the Store's VerifyHolder): a forged record cannot point
	// this worker elsewhere.
	for _, h := range a.cstore.Nearest(rec) {
		refs = append(refs, h.Ref)
	}
	if len(refs) == 0 {
		return in, nil, fmt.Errorf("%w: store object %s has no holders", errInputLost, in.Payload)
	}
	return in, refs, nil
}

// putResult stages a finished file as the job's pinned result object, kept
// for ResultTTL on R holders. When no member has room it is held here beyond
// the Store's capacity (counted as overflow): a decode must always be able to
// finish, since finishing is what frees the latents filling the Store.
// The result's retention lease is etcd's to grant: while etcd does not
// answer, the file is kept and staged again after a backoff, for as long as
// the task may still commit (as commit does), rather than decoded again.
func (a *Agent) putResult(ctx context.Context, c *jobs.Claim, file []byte, contentType string) (*cache.Staged, *jobs.Result, error) {
	spec := cache.PutSpec{
		ID: jobs.ResultID(c.Task.JobID), Mode: cache.Pinned, Job: c.Task.JobID, TTL: a.cfg.ResultTTL,
		ContentType: contentType, Overflow: true,
	}
	st, err := a.cstore.StageBytes(ctx, spec, file)
	for backoff := a.cfg.RetryBackoff; err != nil && jobs.IsUnavailable(err) && ctx.Err() == nil; backoff = min(2*backoff, 5*time.Second) {
		a.log.Warn("storing the result failed; keeping the file and retrying", zap.String("job", c.Task.JobID),
			zap.Duration("backoff", backoff), zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
			st, err = a.cstore.StageBytes(ctx, spec, file)
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("%w: store result: %v", errTransient, err)
	}
	sum := sha256.Sum256(file)
	return st, &jobs.Result{
		ContentType: contentType, Bytes: int64(len(file)), SHA256: hex.EncodeToString(sum[:]),
		Object: st.Record.ID, ExpiresAt: st.Record.ExpiresAt,
	}, nil
}

// putPreview publishes a decoded frame as a short-lived preview object held
// by this node (advisory: a failure is logged by the caller).
func (a *Agent) putPreview(ctx context.Context, c *jobs.Claim, frame int, png []byte) error {
	_, err := a.cstore.PutBytes(ctx, cache.PutSpec{
		ID: jobs.PreviewID(c.Task.JobID, frame), Mode: cache.TTL, TTL: a.cfg.PreviewTTL, Job: c.Task.JobID,
		ContentType: "image/png", Local: true,
	}, png)
	return err
}

// fetchObject reads a Store object's bytes (frame previews).
func (a *Agent) fetchObject(ctx context.Context, rec cache.Record) ([]byte, error) {
	buf := make([]byte, rec.Size)
	if err := a.cstore.Fetch(ctx, rec, buf); err != nil {
		return nil, err
	}
	return buf, nil
}

// Result returns a finished job's file, read from the nearest holder of its
// Store object and checked against the job record's SHA-256.
func (a *Agent) Result(ctx context.Context, id string) ([]byte, string, error) {
	job, err := a.Get(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if job.State != jobs.Succeeded || job.Result == nil {
		return nil, "", jobs.ErrNotReady
	}
	// The record is read from etcd under the etcd deadline (an unreachable
	// etcd is a 503, not a hang), or without quorum from a live member
	// while etcd has none; the bytes come from a holder under the
	// request's own context, however long the file takes.
	var rec cache.Record
	lookup := func() error {
		err := a.onEtcd(ctx, func(ctx context.Context) (err error) {
			rec, err = a.cstore.Lookup(ctx, job.Result.Object)
			return err
		})
		if errors.Is(err, jobs.ErrUnavailable) {
			rec, err = a.lookupWithoutQuorum(ctx, job.Result.Object, err)
		}
		return err
	}
	// Gone before its retention ended means lost, not expired.
	gone := jobs.ErrExpired
	if time.Now().Before(job.Result.ExpiresAt) {
		gone = jobs.ErrResultLost
	}
	if err := lookup(); errors.Is(err, cache.ErrNotFound) {
		return nil, "", fmt.Errorf("%w: %s", gone, job.Result.Object)
	} else if err != nil {
		return nil, "", fmt.Errorf("agent: result of %s: %w", id, err)
	}
	data := make([]byte, rec.Size)
	err = a.cstore.Fetch(ctx, rec, data)
	if errors.Is(err, cache.ErrNotFound) {
		// Every holder refused: the object expired meanwhile, or every
		// copy it names is gone.
		return nil, "", fmt.Errorf("%w: %s: %v", gone, job.Result.Object, err)
	}
	if err != nil {
		return nil, "", fmt.Errorf("agent: result of %s: %w", id, err)
	}
	if sum := sha256.Sum256(data); hex.EncodeToString(sum[:]) != job.Result.SHA256 || int64(len(data)) != job.Result.Bytes {
		return nil, "", fmt.Errorf("agent: result of %s does not match its checksum", id)
	}
	return data, job.Result.ContentType, nil
}

// checkSubmit refuses new work the mesh cannot take: while etcd's database
// is full (NOSPACE), and, for jobs relayed through the Store, while no
// member has Store room for the job's largest payload, in memory or on disk.
// Jobs already accepted are not affected: they wait for room.
func (a *Agent) checkSubmit(spec engine.Spec, opts jobs.Options) error {
	if err := a.alarms.NoSpace(); err != nil {
		return err
	}
	if err := a.etcdDown(); err != nil {
		return err
	}
	// The built-in model is always accepted, served or not yet, as before
	// models: its jobs wait in the queue for agents to come.
	if spec.ModelName() != engine.DefaultModel && !a.modelServed(spec.ModelName()) {
		return &engine.FieldError{Field: "model", Msg: fmt.Sprintf("%q: no agent of this mesh serves it on every stage", spec.ModelName())}
	}
	if err := a.checkAdapter(spec); err != nil {
		return err
	}
	mode := opts.Transfer
	if mode == "" {
		mode = a.cfg.TransferMode
	}
	if mode != jobs.StoreRelay {
		return nil
	}
	meta, err := a.runner.LatentMeta(spec)
	if err != nil {
		return nil // not served here: the Store check is for agents that know the latent
	}
	need := meta.Bytes()
	total, largest := a.storeRoom()
	if largest < need {
		return fmt.Errorf("%w: the Store has no room for this job's %d-byte latent in memory or on disk (%d bytes free across the mesh, at most %d on one agent); retry when running jobs have finished",
			jobs.ErrStoreFull, need, total, largest)
	}
	return nil
}

// StoreView is the admin view of the Store: the objects as etcd records
// them, and this node's part.
type StoreView struct {
	Summary cache.Summary    `json:"summary"`
	Local   cache.LocalStats `json:"local"`
	Node    string           `json:"node"`
	Objects []cache.Record   `json:"objects,omitempty"`
}

// StoreStatus reads the Store's records (those of job when set) and this
// node's holdings; list includes the records themselves.
func (a *Agent) StoreStatus(ctx context.Context, job string, list bool) (StoreView, error) {
	prefix := ""
	if job != "" {
		prefix = cache.JobObjectID(job, "")
	}
	recs, err := a.cstore.List(ctx, prefix)
	if err != nil {
		return StoreView{}, err
	}
	v := StoreView{Summary: cache.Summarize(recs), Local: a.cstore.LocalStats(), Node: a.id}
	if list {
		v.Objects = recs
	}
	return v, nil
}

// modelServed reports whether, as gossip tells, some live member serves
// each stage of model. A model nobody serves would wait in the queue for
// ever; an engine that registers a moment later shows in gossip within a
// second, so a client retrying then is accepted.
func (a *Agent) modelServed(model string) bool {
	for _, st := range jobs.Stages() {
		served := false
		for _, p := range a.member.Peers() {
			if p.Alive && p.Record.HasRole(string(st)) && p.Meta.Serves(string(st), model, engine.DefaultModel) {
				served = true
				break
			}
		}
		if !served {
			return false
		}
	}
	return true
}
