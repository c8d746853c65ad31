package engine

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func schema() []ParamSpec {
	return []ParamSpec{
		{Name: "shift", Type: ParamTypeNumber, Min: 1, Max: 10, Default: NumberParam(3)},
		{Name: "cfg_steps", Type: ParamTypeInteger, Min: 0, Max: 50, Default: IntegerParam(0)},
		{Name: "true_cfg", Type: ParamTypeBool, Default: BoolParam(false)},
		{Name: "sampler", Type: ParamTypeEnum, Values: []string{"euler", "unipc"}, Default: StringParam("euler")},
	}
}

// A value is its plain JSON and msgpack self, and reads back as the same
// kind: an integer written without a fraction stays one.
func TestParamValueEncodings(t *testing.T) {
	in := Params{"a": NumberParam(2.5), "b": IntegerParam(-7), "c": BoolParam(true), "d": StringParam("unipc"), "e": NumberParam(1e300)}
	js, err := json.Marshal(in)
	if err != nil || string(js) != `{"a":2.5,"b":-7,"c":true,"d":"unipc","e":1e+300}` {
		t.Fatalf("JSON %s, %v", js, err)
	}
	var back Params
	if err := json.Unmarshal(js, &back); err != nil || !reflect.DeepEqual(back, in) {
		t.Fatalf("JSON round trip %v, %v", back, err)
	}
	mp, err := msgpack.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := msgpack.Marshal(in)
	if string(mp) != string(again) {
		t.Error("the same params encode to different msgpack bytes")
	}
	var mback Params
	if err := msgpack.Unmarshal(mp, &mback); err != nil || !reflect.DeepEqual(mback, in) {
		t.Fatalf("msgpack round trip %v, %v", mback, err)
	}
	for _, bad := range []string{`{"a":null}`, `{"a":[1]}`, `{"a":{}}`} {
		var p Params
		if err := json.Unmarshal([]byte(bad), &p); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
	// msgpack decodes nil to the zero value, a value of no kind, which
	// every check refuses (extengine's frame check, ApplyParams).
	nilVal, _ := msgpack.Marshal(map[string]any{"a": nil})
	var p Params
	if err := msgpack.Unmarshal(nilVal, &p); err == nil && p["a"].Kind != 0 {
		t.Errorf("a msgpack nil decoded to %v", p["a"])
	}
	if _, err := ApplyParams(schema(), Params{"shift": {}}); err == nil {
		t.Error("a value of no kind accepted")
	}
}

// A request's parameters: each given one checked and converted to its
// type, each left out at its default; anything else a field error naming
// the parameter.
func TestApplyParams(t *testing.T) {
	got, err := ApplyParams(schema(), Params{"shift": IntegerParam(5), "cfg_steps": NumberParam(4), "sampler": StringParam("unipc")})
	want := Params{"shift": NumberParam(5), "cfg_steps": IntegerParam(4), "true_cfg": BoolParam(false), "sampler": StringParam("unipc")}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("ApplyParams = %v, %v; want %v", got, err, want)
	}
	for _, tc := range []struct {
		in   Params
		want string
	}{
		{Params{"shift": NumberParam(0.5)}, `"shift": 0.5: must be in [1,10]`},
		{Params{"shift": StringParam("5")}, `"shift": "5": want a number`},
		{Params{"cfg_steps": NumberParam(2.5)}, `"cfg_steps": 2.5: want an integer`},
		{Params{"cfg_steps": IntegerParam(51)}, `"cfg_steps": 51: must be in [0,50]`},
		{Params{"true_cfg": IntegerParam(1)}, `"true_cfg": 1: want true or false`},
		{Params{"sampler": StringParam("ddim")}, `"sampler": "ddim": want one of euler, unipc`},
		{Params{"sheft": NumberParam(2)}, `"sheft": unknown; the model takes shift, cfg_steps, true_cfg, sampler`},
	} {
		_, err := ApplyParams(schema(), tc.in)
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != "params" || !strings.Contains(fe.Msg, tc.want) {
			t.Errorf("%v: %v, want a params error saying %q", tc.in, err, tc.want)
		}
	}
	if _, err := ApplyParams(nil, Params{"shift": NumberParam(2)}); err == nil || !strings.Contains(err.Error(), "the model takes no parameters") {
		t.Errorf("params for a model without a schema: %v", err)
	}
	// A default read back from JSON (a node record) as an integer is
	// still a number parameter's number.
	sc := schema()
	sc[0].Default = IntegerParam(3)
	if p, err := ApplyParams(sc, nil); err != nil || p["shift"] != NumberParam(3) {
		t.Errorf("an integer default of a number parameter: %v, %v; want the number 3", p["shift"], err)
	}
	if p, err := ApplyParams(nil, nil); p != nil || err != nil {
		t.Errorf("no schema, no params: %v, %v", p, err)
	}
	if CanonicalParams(want) != CanonicalParams(Params{"sampler": StringParam("unipc"), "true_cfg": BoolParam(false), "cfg_steps": IntegerParam(4), "shift": NumberParam(5)}) {
		t.Error("equal params, different canonical strings")
	}
}

// A reference image: refused by a model that takes none, required by one
// that says so, bounded in pixels.
func TestCheckImage(t *testing.T) {
	takes, needs := ModelInputs{Image: &ImageInput{}}, ModelInputs{Image: &ImageInput{Required: true}}
	for _, tc := range []struct {
		in   ModelInputs
		has  bool
		w, h int
		want string
	}{
		{ModelInputs{}, true, 64, 64, "the model takes no image"},
		{needs, false, 0, 0, "the model needs a reference image"},
		{takes, true, 4097, 8, "4097x8"},
		{takes, true, 4096, 4096, "4096x4096"},
		{takes, false, 0, 0, ""},
		{needs, true, 2048, 2048, ""},
	} {
		err := tc.in.CheckImage(tc.has, tc.w, tc.h)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%+v has %v %dx%d: %v, want %q", tc.in, tc.has, tc.w, tc.h, err, tc.want)
		}
	}
}
