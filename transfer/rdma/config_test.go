package rdma

import (
	"errors"
	"testing"
	"time"
)

func TestDefaultConfigValid(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		name string
		mod  func(*Config)
	}{
		{"port 0", func(c *Config) { c.Port = 0 }},
		{"gid index -2", func(c *Config) { c.GIDIndex = -2 }},
		{"gid index 256", func(c *Config) { c.GIDIndex = 256 }},
		{"mtu 1500", func(c *Config) { c.MTU = 1500 }},
		{"queue depth 0", func(c *Config) { c.QueueDepth = 0 }},
		{"queue depth huge", func(c *Config) { c.QueueDepth = maxQueueDepth + 1 }},
		{"max wr 0", func(c *Config) { c.MaxWR = 0 }},
		{"max wr 2 GiB", func(c *Config) { c.MaxWR = 2 << 30 }},
		{"read atomic 0", func(c *Config) { c.ReadAtomic = 0 }},
		{"read atomic 256", func(c *Config) { c.ReadAtomic = 256 }},
		{"unknown poll", func(c *Config) { c.Poll = 9 }},
		{"spin with event", func(c *Config) { c.SpinTime = time.Microsecond }},
		{"hybrid without spin", func(c *Config) { c.Poll = PollHybrid }},
		{"hybrid spin too long", func(c *Config) { c.Poll, c.SpinTime = PollHybrid, time.Second }},
		{"timeout 32", func(c *Config) { c.Timeout = 32 }},
		{"retry 8", func(c *Config) { c.RetryCount = 8 }},
		{"rnr retry 8", func(c *Config) { c.RNRRetry = 8 }},
		{"rnr timer 32", func(c *Config) { c.MinRNRTimer = 32 }},
		{"drain 0", func(c *Config) { c.DrainTimeout = 0 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.mod(&c)
			if err := c.Validate(); !errors.Is(err, ErrBadConfig) {
				t.Fatalf("Validate() = %v, want ErrBadConfig", err)
			}
		})
	}
	ok := DefaultConfig()
	ok.Poll, ok.SpinTime, ok.GIDIndex, ok.MTU = PollHybrid, 20*time.Microsecond, -1, 256
	if err := ok.Validate(); err != nil {
		t.Fatalf("hybrid, lid-only, mtu 256: %v", err)
	}
}

func TestClampTo(t *testing.T) {
	base := DefaultConfig()
	cases := []struct {
		name string
		lim  deviceLimits
		want func(*Config)
	}{
		{"no limits", deviceLimits{}, func(*Config) {}},
		{"generous", deviceLimits{MaxQPWR: 1 << 15, MaxCQE: 1 << 22, MaxRdAtom: 16, MaxInitRdAtom: 16, MaxMsg: 1 << 31, ActiveMTU: 5}, func(*Config) {}},
		{"qp wr", deviceLimits{MaxQPWR: 10}, func(c *Config) { c.QueueDepth = 10 }},
		{"cqe", deviceLimits{MaxCQE: 10}, func(c *Config) { c.QueueDepth = 9 }},
		{"msg", deviceLimits{MaxMsg: 4096}, func(c *Config) { c.MaxWR = 4096 }},
		{"rd atom", deviceLimits{MaxRdAtom: 8, MaxInitRdAtom: 4}, func(c *Config) { c.ReadAtomic = 4 }},
		{"roce mtu", deviceLimits{ActiveMTU: 3}, func(c *Config) { c.MTU = 1024 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			want := base
			tc.want(&want)
			if got := base.clampTo(tc.lim); got != want {
				t.Fatalf("clampTo = %+v, want %+v", got, want)
			}
		})
	}
}

func TestMTUCodes(t *testing.T) {
	for code := uint8(1); code <= 5; code++ {
		if mtuCode(mtuBytes(code)) != code {
			t.Fatalf("code %d does not round-trip", code)
		}
	}
	if mtuBytes(0) != 0 || mtuBytes(6) != 0 || mtuCode(9000) != 0 {
		t.Fatal("unknown MTUs map to non-zero")
	}
}

func TestPollStrategyString(t *testing.T) {
	if PollEvent.String() != "event" || PollHybrid.String() != "hybrid" || PollStrategy(7).String() != "PollStrategy(7)" {
		t.Fatal("PollStrategy.String")
	}
}
