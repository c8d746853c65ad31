package jobs

import (
	"context"
	"errors"
	"slices"
	"testing"
)

// List pages through jobs in creation order, either way, keeping the
// matching ones, and says when more follow.
func TestList(t *testing.T) {
	s, _ := newStore(t)
	ctx := context.Background()
	var all, videos []string
	for i := range 7 {
		sp := spec()
		if i%2 == 0 {
			sp.Frames = 4
		}
		j, err := s.Submit(ctx, sp, Options{})
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, j.ID)
		if sp.Frames > 1 {
			videos = append(videos, j.ID)
		}
	}
	ids := func(js []Job) []string {
		out := make([]string, len(js))
		for i, j := range js {
			out[i] = j.ID
		}
		return out
	}
	page, more, err := s.List(ctx, ListQuery{Limit: 100})
	if err != nil || more || !slices.Equal(ids(page), all) {
		t.Fatalf("all: %v more %v err %v; want %v", ids(page), more, err, all)
	}
	isVideo := func(j Job) bool { return j.Spec.Frames > 1 }
	// Newest first, two at a time, following the cursor.
	var got []string
	after := ""
	for range 10 {
		page, more, err := s.List(ctx, ListQuery{After: after, Limit: 2, Newest: true, Match: isVideo})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ids(page)...)
		if !more {
			break
		}
		after = page[len(page)-1].ID
	}
	want := slices.Clone(videos)
	slices.Reverse(want)
	if !slices.Equal(got, want) {
		t.Fatalf("videos newest first: %v, want %v", got, want)
	}
	page, more, err = s.List(ctx, ListQuery{After: all[2], Limit: 1, Match: isVideo})
	if err != nil || !more || !slices.Equal(ids(page), []string{videos[2]}) {
		t.Fatalf("after %s: %v more %v err %v", all[2], ids(page), more, err)
	}
	if _, _, err := s.List(ctx, ListQuery{After: "0123456789abcdef", Limit: 1}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after an unknown job: %v", err)
	}
	if _, _, err := s.List(ctx, ListQuery{Limit: 0}); err == nil {
		t.Fatal("limit 0 listed")
	}
}
