package bytesize

import (
	"fmt"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"4MiB", 4 << 20},
		{"256MiB", 256 << 20},
		{"1GiB", 1 << 30},
		{"512kib", 512 << 10},
		{"64MB", 64e6},
		{"1048576", 1 << 20},
		{"10B", 10},
		{" 2 MiB ", 2 << 20},
	} {
		got, err := Parse(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("Parse(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	for _, in := range []string{"", "MiB", "4XB", "0MiB", "-1MiB", "1.5MiB", "99999999999GiB", "4MiBs"} {
		if n, err := Parse(in); err == nil {
			t.Errorf("Parse(%q) = %d, want an error", in, n)
		}
	}
}

func TestParseList(t *testing.T) {
	got, err := ParseList("4MiB,64MiB,1GiB")
	if err != nil {
		t.Fatal(err)
	}
	if want := []int64{4 << 20, 64 << 20, 1 << 30}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("ParseSizes = %v, want %v", got, want)
	}
	for _, in := range []string{"", "4MiB,", "4MiB,,8MiB", "4MiB;8MiB", "4MiB,big"} {
		if _, err := ParseList(in); err == nil {
			t.Errorf("ParseList(%q): want an error", in)
		}
	}
}

func TestFormat(t *testing.T) {
	for n, want := range map[int64]string{4 << 20: "4MiB", 1 << 30: "1GiB", 1536: "1536B", 3 << 10: "3KiB", 7: "7B"} {
		if got := Format(n); got != want {
			t.Errorf("Format(%d) = %q, want %q", n, got, want)
		}
	}
}
