package agent

// This file holds what a request carries beyond its text and sizes (issue
// 20): a model's own parameters and a reference image. The agent that
// takes a request checks both against what the model's engine declared
// (the node records' model entries, models.go), fills in the parameters'
// defaults, and stages the image, decoded to RGBA, as a Store object of
// the job, released when the job ends; the agents running the stages the
// model names read it back and hand it to their engine.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
)

// imageReplicas is how many copies of a reference image the Store keeps:
// a rewound job encodes again and needs it, after its first holder died.
const imageReplicas = 2

// errImageLost: a job's reference image is gone from the Store (every
// holder lost it); the client's upload cannot be made again, so the job
// fails.
var errImageLost = errors.New("agent: reference image lost")

// submitInputs checks spec's parameters and opts' image against what
// spec's model takes, completes the parameters, stages the image for the
// job (whose id it picks) and notes the latent's frames. abort undoes the
// staging when the submission fails after it.
func (a *Agent) submitInputs(ctx context.Context, spec *engine.Spec, opts *jobs.Options) (abort func(), err error) {
	abort = func() {}
	if spec.Image != nil {
		// Only a fork copies a spec with an image: the image is its
		// job's, released when that job ends.
		return abort, &engine.FieldError{Field: "image", Msg: "a job with a reference image cannot be forked: its image ends with it; submit the image again"}
	}
	rec, _ := a.modelRecordFor(spec.ModelName())
	params, err := engine.ApplyParams(rec.Inputs.Params, spec.Params)
	if err != nil {
		return abort, err
	}
	spec.Params = params
	img := opts.Image
	w, h := 0, 0
	if img != nil {
		w, h = img.Width, img.Height
	}
	if err := rec.Inputs.CheckImage(img != nil, w, h); err != nil {
		return abort, err
	}
	if rec.Temporal > 1 {
		opts.LatentFrames = latentFrames(rec.Temporal, spec.Frames)
	}
	if img == nil {
		return abort, nil
	}
	if int64(len(img.Pix)) != 4*int64(w)*int64(h) {
		return abort, &engine.FieldError{Field: "image", Msg: fmt.Sprintf("%d bytes of pixels for %dx%d RGBA", len(img.Pix), w, h)}
	}
	if opts.JobID == "" {
		opts.JobID = jobs.NewID()
	}
	id := jobs.ImageID(opts.JobID)
	st, err := a.cstore.StageBytes(ctx, cache.PutSpec{ID: id, Mode: cache.Consume, Job: opts.JobID, Replicas: imageReplicas,
		ContentType: "application/x-latentmesh-rgba"}, img.Pix)
	if errors.Is(err, cache.ErrFull) {
		return abort, fmt.Errorf("%w: no room for the reference image: %v", jobs.ErrStoreFull, err)
	}
	if err != nil {
		return abort, fmt.Errorf("agent: store the reference image: %w", err)
	}
	sum := sha256.Sum256(img.Pix)
	spec.Image = &engine.ImageRef{Object: id, Width: w, Height: h, SHA256: hex.EncodeToString(sum[:])}
	opts.Records = append(opts.Records, st)
	opts.Image = nil // staged: the job record carries the reference
	return func() { st.Abort(a.ctx) }, nil
}

// latentFrames is model.LatentFrames for a temporal factor t.
func latentFrames(t, frames int) int {
	return extengine.Model{Latent: extengine.LatentLayout{Temporal: int32(t)}}.LatentFrames(frames)
}

// jobImages reads a job's reference image (the agent's Store).
type jobImages interface {
	// jobImage returns ref's pixels in a buffer of this agent's (its
	// arena when it has room): call release when done with them.
	jobImage(ctx context.Context, ref engine.ImageRef) (pix []byte, release func(), err error)
}

// jobImage reads ref from the Store, checking it is the image the job was
// submitted with.
func (a *Agent) jobImage(ctx context.Context, ref engine.ImageRef) ([]byte, func(), error) {
	rec, err := a.cstore.Lookup(ctx, ref.Object)
	switch {
	case errors.Is(err, cache.ErrNotFound):
		return nil, nil, fmt.Errorf("%w: %s: %v", errImageLost, ref.Object, err)
	case err != nil:
		return nil, nil, fmt.Errorf("%w: reference image %s: %v", errTransient, ref.Object, err)
	case rec.Size != ref.Bytes():
		return nil, nil, fmt.Errorf("%w: %s holds %d bytes, a %dx%d image %d", errImageLost, ref.Object, rec.Size, ref.Width, ref.Height, ref.Bytes())
	}
	dst, release := a.buffer(rec.Size)
	if err := a.cstore.Fetch(ctx, rec, dst); err != nil {
		release()
		if errors.Is(err, cache.ErrNotFound) {
			return nil, nil, fmt.Errorf("%w: %v", errImageLost, err)
		}
		return nil, nil, fmt.Errorf("%w: reference image: %v", errTransient, err)
	}
	if sum := sha256.Sum256(dst); hex.EncodeToString(sum[:]) != ref.SHA256 {
		release()
		return nil, nil, fmt.Errorf("%w: %s does not match its checksum", errImageLost, ref.Object)
	}
	return dst, release, nil
}

// refImage is s's reference image for stage st of its model, in the
// arena, when the model takes one there (nil otherwise); release it after
// the call.
func (x *externalRunner) refImage(ctx context.Context, st string, s engine.Spec) (*extengine.Tensor, func(), error) {
	nop := func() {}
	m, ok := x.srv.Engine().Model(st, s.ModelName())
	if !ok || m.Image == nil || !slices.Contains(m.Image.Stages, st) || s.Image == nil {
		return nil, nop, nil // a required image missing is the Server's to refuse
	}
	if x.images == nil {
		return nil, nop, fmt.Errorf("%w: this agent cannot read reference images", extengine.ErrNoImage)
	}
	pix, release, err := x.images.jobImage(ctx, *s.Image)
	if err != nil {
		return nil, nop, err
	}
	in, relIn, err := x.inArena(pix)
	if err != nil {
		release()
		return nil, nop, err
	}
	x.log.Debug("reference image for the engine", zap.String("stage", st), zap.Int("width", s.Image.Width), zap.Int("height", s.Image.Height))
	return &extengine.Tensor{DType: "uint8", Shape: []int64{int64(s.Image.Height), int64(s.Image.Width), 4}, Data: in},
		func() { relIn(); release() }, nil
}
