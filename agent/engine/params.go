package engine

// This file holds what a request carries beyond the text and the sizes: a
// model's own parameters (sampler shift, true CFG scale, a guidance
// rescale), validated against the schema the model registered, and a
// reference image (image-to-video, image edits). The built-in model takes
// neither; an external engine's model declares them (extengine.Model), and
// the agent that takes a request checks it against the declaration.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Bounds on a parameter schema and on a request's parameters: they travel
// in node records, job records and every task.
const (
	MaxParams      = 16 // parameters of a model, and in a request
	MaxParamName   = 32 // bytes of [a-z0-9_]
	MaxParamValues = 16 // values of an enum
	MaxParamString = 64 // bytes of an enum value
	// maxParamMagnitude bounds numbers (2^53: integers stay exact in a
	// float64 and in JSON clients).
	maxParamMagnitude = 1 << 53
)

// Parameter types.
const (
	ParamTypeNumber  = "number"  // a float64 in [Min, Max]
	ParamTypeInteger = "integer" // an int64 in [Min, Max]
	ParamTypeBool    = "bool"
	ParamTypeEnum    = "enum" // one of Values
)

// ParamSpec is one parameter a model takes, as its engine registers it.
type ParamSpec struct {
	Name string `json:"name" msgpack:"name"`
	Type string `json:"type" msgpack:"type"`
	// Min and Max bound a number or an integer (both required for them,
	// integral for an integer); unused otherwise.
	Min float64 `json:"min,omitempty" msgpack:"min,omitempty"`
	Max float64 `json:"max,omitempty" msgpack:"max,omitempty"`
	// Default is what a request that leaves the parameter out gets.
	Default ParamValue `json:"default" msgpack:"default"`
	// Values are an enum's choices.
	Values []string `json:"values,omitempty" msgpack:"values,omitempty"`
}

// Params are a request's parameters by name. In msgpack they are a map
// in name order, so that equal parameters are equal bytes.
type Params map[string]ParamValue

var _ msgpack.CustomEncoder = Params(nil)

// EncodeMsgpack writes the map with its keys sorted.
func (p Params) EncodeMsgpack(enc *msgpack.Encoder) error {
	if p == nil {
		return enc.EncodeNil()
	}
	if err := enc.EncodeMapLen(len(p)); err != nil {
		return err
	}
	for _, k := range sortedKeys(p) {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		if err := p[k].EncodeMsgpack(enc); err != nil {
			return err
		}
	}
	return nil
}

// ParamKind is the kind of a ParamValue.
type ParamKind uint8

// Kinds of ParamValue; the zero ParamValue has none and is invalid.
const (
	ParamNumber ParamKind = iota + 1
	ParamInteger
	ParamBool
	ParamString
)

// ParamValue is one parameter's value: a number, an integer, a bool or a
// string (an enum's). In JSON and msgpack it is the plain value.
type ParamValue struct {
	Kind ParamKind
	Num  float64
	Int  int64
	Bool bool
	Str  string
}

// NumberParam, IntegerParam, BoolParam and StringParam make ParamValues.
func NumberParam(f float64) ParamValue { return ParamValue{Kind: ParamNumber, Num: f} }
func IntegerParam(i int64) ParamValue  { return ParamValue{Kind: ParamInteger, Int: i} }
func BoolParam(b bool) ParamValue      { return ParamValue{Kind: ParamBool, Bool: b} }
func StringParam(s string) ParamValue  { return ParamValue{Kind: ParamString, Str: s} }

func (v ParamValue) String() string {
	switch v.Kind {
	case ParamNumber:
		return strconv.FormatFloat(v.Num, 'g', -1, 64)
	case ParamInteger:
		return strconv.FormatInt(v.Int, 10)
	case ParamBool:
		return strconv.FormatBool(v.Bool)
	case ParamString:
		return strconv.Quote(v.Str)
	}
	return "<none>"
}

// MarshalJSON writes the plain value.
func (v ParamValue) MarshalJSON() ([]byte, error) {
	switch v.Kind {
	case ParamNumber:
		if math.IsNaN(v.Num) || math.IsInf(v.Num, 0) {
			return nil, fmt.Errorf("engine: parameter value %v is not a JSON number", v.Num)
		}
		return json.Marshal(v.Num)
	case ParamInteger:
		return json.Marshal(v.Int)
	case ParamBool:
		return json.Marshal(v.Bool)
	case ParamString:
		return json.Marshal(v.Str)
	}
	return nil, errors.New("engine: a parameter value of no kind")
}

// UnmarshalJSON reads a number (an integer when written without a
// fraction or an exponent), a bool or a string.
func (v *ParamValue) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case len(b) == 0:
		return errors.New("engine: empty parameter value")
	case b[0] == '"':
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*v = StringParam(s)
	case string(b) == "true" || string(b) == "false":
		*v = BoolParam(b[0] == 't')
	case b[0] == '-' || b[0] >= '0' && b[0] <= '9':
		if !bytes.ContainsAny(b, ".eE") {
			if i, err := strconv.ParseInt(string(b), 10, 64); err == nil {
				*v = IntegerParam(i)
				return nil
			}
		}
		f, err := strconv.ParseFloat(string(b), 64)
		if err != nil {
			return fmt.Errorf("engine: parameter value %s: %w", b, err)
		}
		*v = NumberParam(f)
	default:
		return fmt.Errorf("engine: parameter value %s: want a number, a bool or a string", b)
	}
	return nil
}

var (
	_ msgpack.CustomEncoder = ParamValue{}
	_ msgpack.CustomDecoder = (*ParamValue)(nil)
)

// EncodeMsgpack writes the plain value: a float 64, an int, a bool or a str.
func (v ParamValue) EncodeMsgpack(enc *msgpack.Encoder) error {
	switch v.Kind {
	case ParamNumber:
		return enc.EncodeFloat64(v.Num)
	case ParamInteger:
		return enc.EncodeInt(v.Int)
	case ParamBool:
		return enc.EncodeBool(v.Bool)
	case ParamString:
		return enc.EncodeString(v.Str)
	}
	return errors.New("engine: a parameter value of no kind")
}

// DecodeMsgpack reads a float, an int, a bool or a str; anything else
// (nil, a container) is an error. The bytes were bounded before decoding.
func (v *ParamValue) DecodeMsgpack(dec *msgpack.Decoder) error {
	c, err := dec.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case c == msgpcode.Float || c == msgpcode.Double:
		f, err := dec.DecodeFloat64()
		if err != nil {
			return err
		}
		*v = NumberParam(f)
	case c == msgpcode.Uint64:
		u, err := dec.DecodeUint64()
		if err != nil {
			return err
		}
		if u > math.MaxInt64 {
			return fmt.Errorf("engine: parameter value %d out of range", u)
		}
		*v = IntegerParam(int64(u))
	case msgpcode.IsFixedNum(c) || c == msgpcode.Uint8 || c == msgpcode.Uint16 || c == msgpcode.Uint32 ||
		c == msgpcode.Int8 || c == msgpcode.Int16 || c == msgpcode.Int32 || c == msgpcode.Int64:
		i, err := dec.DecodeInt64()
		if err != nil {
			return err
		}
		*v = IntegerParam(i)
	case c == msgpcode.True || c == msgpcode.False:
		b, err := dec.DecodeBool()
		if err != nil {
			return err
		}
		*v = BoolParam(b)
	case msgpcode.IsString(c):
		s, err := dec.DecodeString()
		if err != nil {
			return err
		}
		*v = StringParam(s)
	default:
		return fmt.Errorf("engine: parameter value of msgpack code %#x: want a number, a bool or a string", c)
	}
	return nil
}

// ValidParamName reports whether s can name a parameter: 1 to
// MaxParamName bytes of [a-z0-9_], starting with a letter.
func ValidParamName(s string) bool {
	if s == "" || len(s) > MaxParamName || s[0] < 'a' || s[0] > 'z' {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// validEnumValue reports whether s can be an enum's value: 1 to
// MaxParamString bytes of [A-Za-z0-9._-].
func validEnumValue(s string) bool {
	if s == "" || len(s) > MaxParamString {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// ValidateSchema checks a model's parameter schema: at most MaxParams,
// unique names, known types, ranges that hold their default. The error
// names the parameter and what is wrong with it.
func ValidateSchema(ps []ParamSpec) error {
	if len(ps) > MaxParams {
		return fmt.Errorf("%d parameters, at most %d", len(ps), MaxParams)
	}
	seen := map[string]bool{}
	for i, p := range ps {
		if !ValidParamName(p.Name) {
			return fmt.Errorf("parameter %d: name %q: want 1-%d bytes of [a-z0-9_], starting with a letter", i, p.Name, MaxParamName)
		}
		if seen[p.Name] {
			return fmt.Errorf("parameter %q declared twice", p.Name)
		}
		seen[p.Name] = true
		if err := p.validate(); err != nil {
			return fmt.Errorf("parameter %q: %v", p.Name, err)
		}
	}
	return nil
}

func (p ParamSpec) validate() error {
	finite := func(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) && math.Abs(f) <= maxParamMagnitude }
	switch p.Type {
	case ParamTypeNumber, ParamTypeInteger:
		if !finite(p.Min) || !finite(p.Max) || p.Min > p.Max {
			return fmt.Errorf("range [%v,%v]: want finite bounds of magnitude at most 2^53, min <= max", p.Min, p.Max)
		}
		if p.Type == ParamTypeInteger && (p.Min != math.Trunc(p.Min) || p.Max != math.Trunc(p.Max)) {
			return fmt.Errorf("range [%v,%v]: an integer's bounds must be integers", p.Min, p.Max)
		}
		if len(p.Values) > 0 {
			return fmt.Errorf("values are for an enum, not a %s", p.Type)
		}
		if _, err := p.check(p.Default); err != nil {
			return fmt.Errorf("default: %v", err)
		}
	case ParamTypeBool:
		if p.Min != 0 || p.Max != 0 || len(p.Values) > 0 {
			return errors.New("a bool takes no range and no values")
		}
		if p.Default.Kind != ParamBool {
			return fmt.Errorf("default %v: want true or false", p.Default)
		}
	case ParamTypeEnum:
		if p.Min != 0 || p.Max != 0 {
			return errors.New("an enum takes no range")
		}
		if len(p.Values) == 0 || len(p.Values) > MaxParamValues {
			return fmt.Errorf("%d values, want 1-%d", len(p.Values), MaxParamValues)
		}
		for i, s := range p.Values {
			if !validEnumValue(s) {
				return fmt.Errorf("value %q: want 1-%d bytes of [A-Za-z0-9._-]", s, MaxParamString)
			}
			if slices.Contains(p.Values[:i], s) {
				return fmt.Errorf("value %q listed twice", s)
			}
		}
		if _, err := p.check(p.Default); err != nil {
			return fmt.Errorf("default: %v", err)
		}
	default:
		return fmt.Errorf("type %q: want number, integer, bool or enum", p.Type)
	}
	return nil
}

// check returns v as p takes it (an integer for a number as a number, an
// integral number for an integer as an integer), or why p refuses it.
func (p ParamSpec) check(v ParamValue) (ParamValue, error) {
	switch p.Type {
	case ParamTypeNumber:
		f := v.Num
		switch v.Kind {
		case ParamInteger:
			f = float64(v.Int)
		case ParamNumber:
		default:
			return v, fmt.Errorf("%v: want a number", v)
		}
		if !(f >= p.Min && f <= p.Max) { // NaN too
			return v, fmt.Errorf("%v: must be in [%v,%v]", v, p.Min, p.Max)
		}
		return NumberParam(f), nil
	case ParamTypeInteger:
		i := v.Int
		switch v.Kind {
		case ParamNumber:
			if v.Num != math.Trunc(v.Num) || math.Abs(v.Num) > maxParamMagnitude {
				return v, fmt.Errorf("%v: want an integer", v)
			}
			i = int64(v.Num)
		case ParamInteger:
		default:
			return v, fmt.Errorf("%v: want an integer", v)
		}
		if float64(i) < p.Min || float64(i) > p.Max {
			return v, fmt.Errorf("%d: must be in [%v,%v]", i, p.Min, p.Max)
		}
		return IntegerParam(i), nil
	case ParamTypeBool:
		if v.Kind != ParamBool {
			return v, fmt.Errorf("%v: want true or false", v)
		}
		return v, nil
	case ParamTypeEnum:
		if v.Kind != ParamString || !slices.Contains(p.Values, v.Str) {
			return v, fmt.Errorf("%v: want one of %s", v, strings.Join(p.Values, ", "))
		}
		return v, nil
	}
	return v, fmt.Errorf("unknown type %q", p.Type)
}

// ApplyParams checks a request's parameters against a model's schema and
// returns them complete: each given one as the schema takes it, each left
// out at its default. An unknown name, a value of the wrong type or out of
// range is a *FieldError of field "params" naming the parameter. A model
// without a schema takes no parameters (nil in, nil out).
func ApplyParams(schema []ParamSpec, in Params) (Params, error) {
	bad := func(format string, a ...any) error {
		return &FieldError{Field: "params", Msg: fmt.Sprintf(format, a...)}
	}
	if len(in) > MaxParams {
		return nil, bad("%d parameters, at most %d", len(in), MaxParams)
	}
	if len(schema) == 0 {
		if len(in) > 0 {
			return nil, bad("the model takes no parameters")
		}
		return nil, nil
	}
	known := make(map[string]ParamSpec, len(schema))
	for _, p := range schema {
		known[p.Name] = p
	}
	for _, name := range sortedKeys(in) {
		if _, ok := known[name]; !ok {
			names := make([]string, 0, len(schema))
			for _, p := range schema {
				names = append(names, p.Name)
			}
			return nil, bad("%q: unknown; the model takes %s", name, strings.Join(names, ", "))
		}
	}
	out := make(Params, len(schema))
	for _, p := range schema {
		v, given := in[p.Name]
		if !given {
			v = p.Default // as the schema takes it: a JSON record reads 5.0 as an integer
		}
		got, err := p.check(v)
		if err != nil {
			if !given {
				return nil, bad("%q: the model's default: %v", p.Name, err)
			}
			return nil, bad("%q: %v", p.Name, err)
		}
		out[p.Name] = got
	}
	return out, nil
}

// CanonicalParams is params as one string, the same for equal maps
// (names sorted): what a cache key names them by.
func CanonicalParams(params Params) string {
	var b strings.Builder
	for _, k := range sortedKeys(params) {
		v := params[k]
		fmt.Fprintf(&b, "%s:%d:%s;", k, v.Kind, v)
	}
	return b.String()
}

func sortedKeys(m Params) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Bounds on a reference image: decoded, it is RGBA pixels in the Store and
// in an engine's arena.
const (
	MaxImageSide   = 4096
	MaxImagePixels = 4 << 20 // 2048x2048: 16 MiB of RGBA
)

// ImageRef is a request's reference image: Width x Height RGBA pixels
// (non-premultiplied, row-major, 4 bytes a pixel) in Store object Object,
// owned by the job and released when it ends. SHA256 is of the pixels.
type ImageRef struct {
	Object string `json:"object"`
	Width  int    `json:"width"`
	Height int    `json:"height"`
	SHA256 string `json:"sha256"`
}

// Bytes is the size of the image's pixels.
func (r ImageRef) Bytes() int64 { return 4 * int64(r.Width) * int64(r.Height) }

// ModelInputs is what a model takes beyond Spec's own fields, as its
// engine declared it: a parameter schema and a reference image.
type ModelInputs struct {
	Params []ParamSpec `json:"params,omitempty"`
	// Image, if set, says the model takes a reference image.
	Image *ImageInput `json:"image,omitempty"`
}

// ImageInput is how a model takes a reference image.
type ImageInput struct {
	// Required: a request without an image is refused.
	Required bool `json:"required,omitempty"`
}

// CheckImage checks a reference image of width x height against the
// bounds and against what the model takes (has says whether the request
// carries one); errors are *FieldError of field "image".
func (in ModelInputs) CheckImage(has bool, width, height int) error {
	bad := func(format string, a ...any) error {
		return &FieldError{Field: "image", Msg: fmt.Sprintf(format, a...)}
	}
	switch {
	case !has && in.Image != nil && in.Image.Required:
		return bad("the model needs a reference image")
	case !has:
		return nil
	case in.Image == nil:
		return bad("the model takes no image")
	case width < 1 || height < 1 || width > MaxImageSide || height > MaxImageSide || width*height > MaxImagePixels:
		return bad("%dx%d: want sides of at most %d pixels and at most %d pixels in all", width, height, MaxImageSide, MaxImagePixels)
	}
	return nil
}
