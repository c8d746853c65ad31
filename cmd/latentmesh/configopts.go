package main

// Options: one table says, for each setting of a command, its name, its
// help, where its value lands and hence its default. Flags are registered
// from it, the config file and LATENTMESH_* variables are read through
// it, and `config print` and `config docs` write it out.

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// option is one setting. Its name is the config file's key and the flag
// (--name); LATENTMESH_<NAME> (upper case, "-" as "_") is its
// environment variable.
type option struct {
	name string
	// value is bound to where the setting lands; its String() before any
	// Set is the default.
	value flag.Value
	help  string
	// doc is the default as docs/config.md states it, for one that
	// depends on the machine; "" states value's.
	doc string
	// secret options (tokens) are left out of `config print` unless asked.
	secret bool
	// short is a one-letter flag standing for the same option.
	short string
}

// envName is the environment variable of option name.
func envName(name string) string {
	return "LATENTMESH_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// kind says how a value is written in YAML: a scalar, a sequence
// (comma-separated on flags), or a mapping (k=v,k=v on flags).
type kind int

const (
	kindString kind = iota // a quoted-when-needed string
	kindPlain              // a number, a bool, a duration, a size
	kindList
	kindMap
)

func kindOf(v flag.Value) kind {
	switch v.(type) {
	case stringValue:
		return kindString
	case listValue, rolesValue:
		return kindList
	case slotsFlag, *simCost:
		return kindMap
	}
	return kindPlain
}

// Values bound to a variable. The zero values (nil pointers) print as ""
// because the flag package makes one to tell a default from a zero.

type stringValue struct{ p *string }

func (v stringValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}
func (v stringValue) Set(s string) error { *v.p = s; return nil }

type boolValue struct{ p *bool }

func (v boolValue) String() string {
	if v.p == nil {
		return "false"
	}
	return strconv.FormatBool(*v.p)
}
func (v boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return fmt.Errorf("want true or false, got %q", s)
	}
	*v.p = b
	return nil
}
func (v boolValue) IsBoolFlag() bool { return true }

type intValue struct{ p *int }

func (v intValue) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.Itoa(*v.p)
}
func (v intValue) Set(s string) error {
	n, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("want an integer, got %q", s)
	}
	*v.p = n
	return nil
}

type floatValue struct{ p *float64 }

func (v floatValue) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.FormatFloat(*v.p, 'g', -1, 64)
}
func (v floatValue) Set(s string) error {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return fmt.Errorf("want a number, got %q", s)
	}
	*v.p = f
	return nil
}

type durationValue struct{ p *time.Duration }

func (v durationValue) String() string {
	if v.p == nil {
		return "0s"
	}
	return v.p.String()
}
func (v durationValue) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("want a duration such as 30s or 2h, got %q", s)
	}
	*v.p = d
	return nil
}

// bytesValue is a byte count written as bytesize takes it (4MiB, 1GiB).
type bytesValue struct{ p *int64 }

func (v bytesValue) String() string {
	if v.p == nil {
		return "0B"
	}
	return bytesize.Format(*v.p)
}
func (v bytesValue) Set(s string) error {
	n, err := bytesize.Parse(s)
	if err != nil {
		return err
	}
	*v.p = n
	return nil
}

// listValue is a comma-separated list; a Set replaces it.
type listValue struct{ p *[]string }

func (v listValue) String() string {
	if v.p == nil {
		return ""
	}
	return strings.Join(*v.p, ",")
}
func (v listValue) Set(s string) error { *v.p = splitList(s); return nil }

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// rolesValue is --roles: stages, comma-separated.
type rolesValue struct{ p *[]jobs.Stage }

func (v rolesValue) String() string {
	if v.p == nil {
		return ""
	}
	var s []string
	for _, st := range *v.p {
		s = append(s, string(st))
	}
	return strings.Join(s, ",")
}
func (v rolesValue) Set(s string) error {
	roles, err := agent.ParseRoles(splitList(s))
	if err != nil {
		return err
	}
	*v.p = roles
	return nil
}

// options is a command's table of options, in the order they are shown.
type options []option

// register adds every option to fs, with the usage line the flag package
// prints from help (a `NAME` in backquotes names the argument).
func (opts options) register(fs *flag.FlagSet) {
	for _, o := range opts {
		fs.Var(o.value, o.name, o.help)
		if o.short != "" {
			fs.Var(o.value, o.short, "short for --"+o.name)
		}
	}
}

func (opts options) lookup(name string) (option, bool) {
	for _, o := range opts {
		if o.name == name {
			return o, true
		}
	}
	return option{}, false
}

// maxConfigFile bounds the config file read: a full one is a few KiB.
const maxConfigFile = 1 << 20

// loadFile sets the options the YAML file at path names. A file that is
// not there is fine when it is only the default (must is false). The
// file is one mapping of option names to values: a scalar, a sequence for
// a list, or a mapping for slots and the like. A key that names no
// option, or one given twice, is an error naming it and its line.
func (opts options) loadFile(path string, must bool, set func(name string)) error {
	data, err := readBounded(path, maxConfigFile)
	if err != nil {
		if !must && errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil // empty, or comments only
		}
		return fmt.Errorf("%s: %w", path, err)
	}
	var more yaml.Node
	if err := dec.Decode(&more); !errors.Is(err, io.EOF) {
		return fmt.Errorf("%s:%d: one YAML document expected, found another", path, more.Line)
	}
	top := doc.Content[0]
	if top.Kind == yaml.ScalarNode && top.Tag == "!!null" {
		return nil
	}
	if top.Kind != yaml.MappingNode {
		return fmt.Errorf("%s:%d: want a mapping of settings (key: value), got a %s", path, top.Line, nodeKind(top))
	}
	first := map[string]int{}
	for i := 0; i+1 < len(top.Content); i += 2 {
		k, v := top.Content[i], top.Content[i+1]
		at := fmt.Sprintf("%s:%d", path, k.Line)
		o, ok := opts.lookup(k.Value)
		if !ok {
			return fmt.Errorf("%s: unknown key %q (docs/config.md lists the keys)", at, k.Value)
		}
		if line, dup := first[k.Value]; dup {
			return fmt.Errorf("%s: key %q given twice (first on line %d)", at, k.Value, line)
		}
		first[k.Value] = k.Line
		s, err := nodeValue(o, v)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", at, k.Value, err)
		}
		if err := o.value.Set(s); err != nil {
			return fmt.Errorf("%s: %s: %w", at, k.Value, err)
		}
		set(o.name)
	}
	return nil
}

// readBounded reads at most limit bytes of path; a longer file is an error.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: over %d bytes", path, limit)
	}
	return b, nil
}

// nodeValue is a YAML value as the option's Set takes it.
func nodeValue(o option, v *yaml.Node) (string, error) {
	if v.Kind == yaml.AliasNode {
		v = v.Alias
	}
	k := kindOf(o.value)
	switch v.Kind {
	case yaml.ScalarNode:
		if v.Tag == "!!null" {
			return "", nil
		}
		return v.Value, nil
	case yaml.SequenceNode:
		if k != kindList {
			return "", fmt.Errorf("want a single value, got a sequence")
		}
		var items []string
		for _, it := range v.Content {
			if it.Kind != yaml.ScalarNode {
				return "", fmt.Errorf("line %d: want a plain item, got a %s", it.Line, nodeKind(it))
			}
			items = append(items, it.Value)
		}
		return strings.Join(items, ","), nil
	case yaml.MappingNode:
		if k != kindMap {
			return "", fmt.Errorf("want a single value, got a mapping")
		}
		var kvs []string
		for i := 0; i+1 < len(v.Content); i += 2 {
			mk, mv := v.Content[i], v.Content[i+1]
			if mv.Kind != yaml.ScalarNode {
				return "", fmt.Errorf("line %d: %s: want a plain value, got a %s", mv.Line, mk.Value, nodeKind(mv))
			}
			kvs = append(kvs, mk.Value+"="+mv.Value)
		}
		return strings.Join(kvs, ","), nil
	}
	return "", fmt.Errorf("unexpected %s", nodeKind(v))
}

func nodeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "sequence"
	case yaml.MappingNode:
		return "mapping"
	case yaml.ScalarNode:
		return "scalar"
	}
	return "node"
}

// loadEnv sets the options whose LATENTMESH_* variable environ holds with
// a value ("" counts as unset). It returns the LATENTMESH_* variables that
// name no option, but for those of other uses (ignored).
func (opts options) loadEnv(environ []string, ignored map[string]bool, set func(name string)) (unknown []string, err error) {
	byEnv := map[string]option{}
	for _, o := range opts {
		byEnv[envName(o.name)] = o
	}
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(k, "LATENTMESH_") || ignored[k] {
			continue
		}
		o, ok := byEnv[k]
		if !ok {
			unknown = append(unknown, k)
			continue
		}
		if v == "" {
			continue
		}
		if err := o.value.Set(v); err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		set(o.name)
	}
	sort.Strings(unknown)
	return unknown, nil
}

// printYAML writes the options as a config file: each key with its help
// as a comment and, where given, where its value came from. Secrets that
// are set are left out (a comment says so) unless secrets is true.
func (opts options) printYAML(w io.Writer, header string, source map[string]string, secrets bool) error {
	top := &yaml.Node{Kind: yaml.MappingNode}
	pending := comment(header, 96) + "\n" // goes above the next key written
	for _, o := range opts {
		val := o.value.String()
		if o.secret && val != "" && !secrets {
			pending += "\n# " + o.name + " is set and not printed (config print --show-secrets prints it)\n"
			continue
		}
		k := &yaml.Node{Kind: yaml.ScalarNode, Value: o.name, HeadComment: pending + "\n" + comment(helpText(o.help), 96)}
		pending = ""
		v := valueNode(kindOf(o.value), val)
		if src := source[o.name]; src != "" {
			v.LineComment = "# from " + src
		}
		top.Content = append(top.Content, k, v)
	}
	top.FootComment = strings.TrimSpace(pending)
	enc := yaml.NewEncoder(w)
	enc.SetIndent(2)
	if err := enc.Encode(top); err != nil {
		return err
	}
	return enc.Close()
}

func valueNode(k kind, val string) *yaml.Node {
	switch k {
	case kindList:
		n := &yaml.Node{Kind: yaml.SequenceNode, Style: yaml.FlowStyle}
		for _, it := range splitList(val) {
			n.Content = append(n.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: it})
		}
		return n
	case kindMap:
		n := &yaml.Node{Kind: yaml.MappingNode, Style: yaml.FlowStyle}
		for _, kv := range splitList(val) {
			mk, mv, _ := strings.Cut(kv, "=")
			n.Content = append(n.Content,
				&yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: mk},
				&yaml.Node{Kind: yaml.ScalarNode, Value: mv})
		}
		return n
	case kindString:
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: val}
	}
	return &yaml.Node{Kind: yaml.ScalarNode, Value: val}
}

// comment turns text into YAML comment lines of at most width columns.
func comment(text string, width int) string {
	var lines []string
	for _, para := range strings.Split(text, "\n") {
		line := "#"
		for _, w := range strings.Fields(para) {
			if len(line)+1+len(w) > width && line != "#" {
				lines = append(lines, line)
				line = "#"
			}
			line += " " + w
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

// helpText is an option's help with the flag package's `NAME` quotes
// taken out, as the docs and comments show it.
func helpText(help string) string { return strings.ReplaceAll(help, "`", "") }

// writeUsage prints the options for -h: flag, environment variable,
// default and help.
func (opts options) writeUsage(w io.Writer) {
	for _, o := range opts {
		name, usage := flag.UnquoteUsage(&flag.Flag{Name: o.name, Usage: o.help, Value: o.value})
		if name == "value" {
			name = argName(o.value)
		}
		line := "  --" + o.name
		if o.short != "" {
			line = "  -" + o.short + ", --" + o.name
		}
		if name != "" {
			line += " " + name
		}
		def := strings.ReplaceAll(o.doc, "`", "")
		if def == "" {
			def = o.value.String()
		}
		fmt.Fprintf(w, "%s    [%s]\n    \t%s", line, envName(o.name), usage)
		if def != "" && def != "false" {
			fmt.Fprintf(w, " (default %s)", def)
		}
		fmt.Fprintln(w)
	}
}

// argName names an option's argument in -h by its type (flag.UnquoteUsage
// says "value" for every flag.Value that is not a built-in one).
func argName(v flag.Value) string {
	switch v.(type) {
	case boolValue:
		return ""
	case intValue, floatValue:
		return "N"
	case durationValue:
		return "DURATION"
	case bytesValue:
		return "SIZE"
	case listValue, rolesValue:
		return "LIST"
	case slotsFlag, *simCost:
		return "K=V,..."
	}
	return "STRING"
}

// writeDocs writes the options as a Markdown table: key, default,
// environment variable, meaning.
func (opts options) writeDocs(w io.Writer) {
	fmt.Fprintln(w, "| key (`--flag`) | default | environment | meaning |")
	fmt.Fprintln(w, "|---|---|---|---|")
	cell := func(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
	for _, o := range opts {
		def := o.doc
		if def == "" {
			def = "`" + o.value.String() + "`"
			if o.value.String() == "" {
				def = "(empty)"
			}
		}
		name := "`" + o.name + "`"
		if o.short != "" {
			name += " (`-" + o.short + "`)"
		}
		help := helpText(o.help)
		if o.secret {
			help += " A secret: not printed by `config print` unless `--show-secrets`."
		}
		fmt.Fprintf(w, "| %s | %s | `%s` | %s |\n", name, cell(def), envName(o.name), cell(help))
	}
}
