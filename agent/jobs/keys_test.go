package jobs

// Tests of the key schema (keys.go).

import (
	"context"
	"errors"
	"testing"
)

func TestBadIDs(t *testing.T) {
	s, _ := newStore(t)
	for _, id := range []string{"", "../jobs", "a/b", "x y", string(make([]byte, 65))} {
		if _, err := s.Get(context.Background(), id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get(%q) = %v, want ErrNotFound", id, err)
		}
	}
}
