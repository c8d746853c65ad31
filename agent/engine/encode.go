package engine

import (
	"context"
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/latentmesh/latentmesh/transfer"
)

// Reserved token ids. Every sequence starts with tokStart; positions after
// the last token are padding, which the encoder outputs as zero rows (what an
// encoder with an attention mask hands on), so pooling can skip them.
const (
	tokPad   = 0
	tokStart = 1
	firstTok = 2
)

// embedTable generates embedding rows on demand from a seed instead of
// storing VocabSize x EmbedDim floats: row i is a pure function of
// (TableSeed, i), which is what a trained table is to its users.
//
// When the embedding is wide enough (semantic), its last semWidth
// dimensions are not random: they hold the codes of known words (see
// semantic.go) and are zero for the rest.
type embedTable struct {
	seed  uint64
	rand  int               // dimensions of the random part, the first ones
	known map[string]uint32 // the known words' token ids; read-only
	codes [][]float64       // code of token id firstTok+i; read-only
}

func newEmbedTable(cfg Config) *embedTable {
	t := &embedTable{seed: cfg.TableSeed, rand: cfg.EmbedDim}
	if semantic(cfg) {
		t.rand = cfg.EmbedDim - semWidth
		t.known, t.codes = newLexicon()
	}
	return t
}

// addToken adds token id's row to dst: its random part, then its code if
// it is a known word or the bare presence of a word if not (the start
// token counts as one word, so an all-unknown prompt reads as no meaning).
func (t *embedTable) addToken(dst []float64, id uint64) {
	t.addRow(dst[:t.rand], saltToken, id, 1)
	if t.rand == len(dst) {
		return
	}
	sem := dst[t.rand:]
	if k := int(id) - firstTok; k >= 0 && k < len(t.codes) {
		for j, v := range t.codes[k] {
			sem[j] += v
		}
		return
	}
	sem[semPresence] += semScale
}

// Salts keep the different generated tables independent.
const (
	saltToken = iota + 1
	saltPos
	saltProj
	saltMix
	saltTexture
	saltAttnW1
	saltAttnB1
	saltAttnK
	saltAttnV
	saltAttnQ
)

// addRow adds scale * row(kind, id) to dst.
func (t *embedTable) addRow(dst []float64, kind, id uint64, scale float64) {
	for j := range dst {
		dst[j] = mad(gauss(hash4(t.seed, kind, id, uint64(j))), scale, dst[j])
	}
}

// tokenize lowercases s, splits it on anything but letters and digits, and
// turns each word into a token id: a known word (in known) its own id, any
// other word a hash into the ids above the known ones, [firstTok+len(known),
// vocab). The result starts with tokStart and holds at most maxTokens ids.
func tokenize(s string, known map[string]uint32, vocab, maxTokens int) []uint32 {
	ids := []uint32{tokStart}
	words := strings.FieldsFunc(strings.ToLower(s), func(r rune) bool {
		return !unicode.IsLetter(r) && !unicode.IsDigit(r)
	})
	first := uint32(firstTok + len(known))
	for _, w := range words {
		if len(ids) == maxTokens {
			break
		}
		if id, ok := known[w]; ok {
			ids = append(ids, id)
			continue
		}
		h := fnv.New32a()
		h.Write([]byte(w))
		ids = append(ids, first+h.Sum32()%(uint32(vocab)-first))
	}
	return ids
}

// Encode embeds the prompt and the negative prompt. The result has shape
// [2, MaxTokens, EmbedDim]: row 0 conditions on the prompt, row 1 on the
// negative prompt (an empty one embeds the bare start token), which
// classifier-free guidance steers away from.
func (e *Engine) Encode(ctx context.Context, s Spec) (Tensor, error) {
	meta := e.CondMeta()
	dst := make([]byte, meta.Bytes())
	meta, err := e.EncodeInto(ctx, s, dst)
	if err != nil {
		return Tensor{}, err
	}
	return Tensor{Meta: meta, Data: dst}, nil
}

// EncodeInto is Encode writing its output into dst, which must be exactly
// CondMeta().Bytes() long (an arena slot, say), instead of a new buffer. Any
// previous content of dst is overwritten. It returns the meta of what it
// wrote; on error dst holds unspecified bytes.
func (e *Engine) EncodeInto(ctx context.Context, s Spec, dst []byte) (transfer.TensorMeta, error) {
	meta := e.CondMeta()
	if err := e.checkSpec(s); err != nil {
		return transfer.TensorMeta{}, err
	}
	if n := meta.Bytes(); int64(len(dst)) != n {
		return transfer.TensorMeta{}, fmt.Errorf("%w: encode into %d bytes, cond needs %d", ErrBadTensor, len(dst), n)
	}
	if err := Spend(ctx, e.cfg.EncodeCost); err != nil {
		return transfer.TensorMeta{}, err
	}
	half := len(dst) / 2
	clear(dst) // padding rows are zero
	e.encodeInto(dst[:half], s.Prompt)
	e.encodeInto(dst[half:], s.NegativePrompt)
	return meta, nil
}

// BranchMeta is the meta of one half of the conditioning, the encoding of
// one text: [1, MaxTokens, EmbedDim] float32, one chunk. CondMeta's tensor
// is the prompt's half followed by the negative prompt's.
func (e *Engine) BranchMeta() transfer.TensorMeta {
	return transfer.TensorMeta{
		DType:     transfer.Float32,
		Shape:     []int64{1, int64(e.cfg.MaxTokens), int64(e.cfg.EmbedDim)},
		NumChunks: 1,
	}
}

// EncodeTextInto writes the encoding of one text (a prompt or a negative
// prompt; it may be empty) into dst, which must be exactly
// BranchMeta().Bytes() long. The halves encode independently, so
// EncodeInto(s) is EncodeTextInto(s.Prompt) followed by
// EncodeTextInto(s.NegativePrompt), byte for byte, and a caller may keep
// the halves apart (a negative prompt shared by many requests, say). Its
// simulated cost is half of EncodeCost.
func (e *Engine) EncodeTextInto(ctx context.Context, text string, dst []byte) error {
	switch {
	case len(text) > e.cfg.Limits.MaxPromptBytes:
		return fmt.Errorf("%w: %w", ErrBadSpec, &FieldError{Field: "text", Msg: fmt.Sprintf("longer than %d bytes", e.cfg.Limits.MaxPromptBytes)})
	case !utf8.ValidString(text):
		return fmt.Errorf("%w: %w", ErrBadSpec, &FieldError{Field: "text", Msg: "not valid UTF-8"})
	}
	if n := e.BranchMeta().Bytes(); int64(len(dst)) != n {
		return fmt.Errorf("%w: encode text into %d bytes, a branch needs %d", ErrBadTensor, len(dst), n)
	}
	if err := Spend(ctx, e.cfg.EncodeCost/2); err != nil {
		return err
	}
	clear(dst) // padding rows are zero
	e.encodeInto(dst, text)
	return nil
}

// encodeInto writes the MaxTokens x EmbedDim float32 encoding of prompt into
// dst, which must be zero. Each position mixes its token, its position and
// the mean of the tokens before it (a one-layer causal "transformer"), then
// is layer-normalised, so word order matters a little and shared words make
// prompts similar.
func (e *Engine) encodeInto(dst []byte, prompt string) {
	d := e.cfg.EmbedDim
	ids := tokenize(prompt, e.table.known, e.cfg.VocabSize, e.cfg.MaxTokens)
	sum := make([]float64, d) // running sum of token rows before position t
	tok := make([]float64, d)
	x := make([]float64, d)
	for t, id := range ids {
		clear(tok)
		e.table.addToken(tok, uint64(id))
		copy(x, tok)
		e.table.addRow(x[:e.table.rand], saltPos, uint64(t), 0.4)
		if t > 0 {
			inv := 0.8 / float64(t)
			for j := range x {
				x[j] = mad(sum[j], inv, x[j])
			}
		}
		for j := range sum {
			sum[j] += tok[j]
		}
		layerNorm(x)
		putFloat32s(dst[4*t*d:4*(t+1)*d], x)
	}
}

// layerNorm scales x to zero mean and unit variance in place.
func layerNorm(x []float64) {
	var mean float64
	for _, v := range x {
		mean += v
	}
	mean /= float64(len(x))
	var ss float64
	for _, v := range x {
		ss = mad(v-mean, v-mean, ss)
	}
	inv := 1 / math.Sqrt(ss/float64(len(x))+1e-6)
	for j, v := range x {
		x[j] = float64((v - mean) * inv)
	}
}

// pool averages the non-padding rows of one n x d encoding and normalises the
// result, giving the prompt's summary vector.
func pool(rows []float32, n, d int) []float64 {
	p := make([]float64, d)
	count := 0
	for t := range n {
		row := rows[t*d : (t+1)*d]
		zero := true
		for _, v := range row {
			if v != 0 {
				zero = false
				break
			}
		}
		if zero {
			continue
		}
		count++
		for j, v := range row {
			p[j] += float64(v)
		}
	}
	if count == 0 {
		return p
	}
	layerNorm(p)
	return p
}
