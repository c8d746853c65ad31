package jobs

// This file holds a job's inputs beyond its spec (issue 20): the reference
// image a request carries, a Store object of the job put with its
// submission and released when the job ends (succeeds, fails or is
// cancelled), like its checkpoints.

import (
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/cache"
)

// ImageUpload is a request's reference image as the client API decoded it:
// Width x Height RGBA pixels, non-premultiplied, row-major. The agent
// stages it as the job's ImageID object and the spec then refers to it
// (engine.Spec.Image).
type ImageUpload struct {
	Width, Height int
	Pix           []byte
}

// ImageID names the Store object of job id's reference image.
func ImageID(id string) string { return cache.JobObjectID(id, "input.image") }

// NewID returns a fresh job (or task) id: what Options.JobID may preset,
// so that the job's objects can be named before it is submitted.
func NewID() string { return newID() }

// validJobID reports whether id can name a job: an id NewID makes.
func validJobID(id string) error {
	if len(id) != 16 || !cache.ValidID(id) {
		return fmt.Errorf("jobs: job id %q: want 16 hex digits (NewID)", id)
	}
	return nil
}

// releaseInputsOps delete the records of rec's input objects (their
// holders then free the copies): at the job's end.
func (s *Store) releaseInputsOps(rec *record) []clientv3.Op {
	if rec.Spec.Image == nil {
		return nil
	}
	return []clientv3.Op{clientv3.OpDelete(cache.ObjectKey(s.cfg.Prefix, rec.Spec.Image.Object))}
}
