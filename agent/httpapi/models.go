package httpapi

// This file is OpenAI's models API (/v1/models): the models the mesh
// serves, as gossip tells the agent answering.

import (
	"net/http"
	"slices"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/videoenc"
)

// ServedModel is one model the mesh can run end to end.
type ServedModel struct {
	Name string
	// Nodes counts the live members whose engine serves some stage of it.
	Nodes int
}

// ModelLister is implemented by a Jobs that knows which models the mesh
// serves. It is optional: without it /v1/models lists the built-in model.
type ModelLister interface {
	// Models lists the models live members serve on every stage.
	Models() []ServedModel
}

// Model is OpenAI's model object, with latentmesh's details.
type Model struct {
	ID         string    `json:"id"`
	Object     string    `json:"object"`  // "model"
	Created    int64     `json:"created"` // unknown: 0
	OwnedBy    string    `json:"owned_by"`
	Latentmesh ModelInfo `json:"latentmesh"`
}

// ModelInfo is the latentmesh extension of a Model.
type ModelInfo struct {
	Nodes int `json:"nodes"` // live members serving a stage of it
}

// ModelList is OpenAI's list of models.
type ModelList struct {
	Object string  `json:"object"` // "list"
	Data   []Model `json:"data"`
}

func (s *server) models() []Model {
	var served []ServedModel
	if ml, ok := s.jobs.(ModelLister); ok {
		served = ml.Models()
	} else {
		served = []ServedModel{{Name: engine.DefaultModel}}
	}
	out := make([]Model, 0, len(served))
	for _, m := range served {
		out = append(out, Model{ID: m.Name, Object: "model", OwnedBy: "latentmesh", Latentmesh: ModelInfo{Nodes: m.Nodes}})
	}
	slices.SortFunc(out, func(a, b Model) int {
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	return out
}

func (s *server) listModels(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, ModelList{Object: "list", Data: s.models()})
}

func (s *server) getModel(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("model")
	for _, m := range s.models() {
		if m.ID == name {
			writeJSON(w, http.StatusOK, m)
			return
		}
	}
	e := apiErr(http.StatusNotFound, typeNotFound, codeInvalidFieldPrefix+"model", "no agent of this mesh serves model %q on every stage", name)
	e.Param = "model"
	writeError(w, e)
}

// newEncoder finds ffmpeg for MP4s; without one (or with "none") videos
// are served as the engine's GIF, and the video objects say so.
func newEncoder(ffmpeg string, log *zap.Logger) *videoenc.Encoder {
	if ffmpeg == "none" {
		return nil
	}
	cfg := videoenc.DefaultConfig()
	cfg.FFmpeg = ffmpeg
	enc, err := videoenc.New(cfg)
	if err != nil {
		log.Warn("no ffmpeg: /v1/videos serves GIF, not MP4", zap.String("ffmpeg", ffmpeg), zap.Error(err))
		return nil
	}
	return enc
}
