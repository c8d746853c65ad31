package rdma

import (
	"fmt"
	"time"
)

// PollStrategy selects how a queue pair waits for work completions.
type PollStrategy uint8

const (
	// PollEvent arms the completion queue (ibv_req_notify_cq) and sleeps on the
	// completion channel's file descriptor in the Go netpoller until the device
	// signals, then drains the queue with ibv_poll_cq. No core is ever spun.
	PollEvent PollStrategy = iota
	// PollHybrid polls the completion queue for at most Config.SpinTime
	// (yielding the processor between polls) before falling back to PollEvent.
	// It trades a bounded amount of CPU for latency on small reads.
	PollHybrid
)

func (p PollStrategy) String() string {
	switch p {
	case PollEvent:
		return "event"
	case PollHybrid:
		return "hybrid"
	}
	return fmt.Sprintf("PollStrategy(%d)", uint8(p))
}

// Limits enforced by Validate.
const (
	maxQueueDepth = 4096    // outstanding work requests per queue pair; also sizes the CQ
	maxWRBytes    = 1 << 30 // ibv_sge.length is 32 bits and devices cap messages at 2^31
	maxSpinTime   = time.Millisecond
)

// Config configures a Device and the queue pairs it creates. Open validates it
// and then clamps it to what the device reports; the Device keeps its own copy.
type Config struct {
	// Device is the verbs device name (as in `ibv_devices`); "" means the first.
	Device string
	// Port is the device port, numbered from 1.
	Port uint8
	// GIDIndex selects the local GID table entry used for routed (RoCE, or IB
	// across subnets) addressing; -1 uses the LID only (InfiniBand in one subnet).
	GIDIndex int
	// MTU is the largest path MTU in bytes (256, 512, 1024, 2048 or 4096); the
	// connection uses the smallest of this, the local and the remote port MTU.
	MTU int
	// QueueDepth bounds the work requests outstanding on one queue pair.
	QueueDepth int
	// MaxWR bounds the bytes one RDMA READ work request moves.
	MaxWR int64
	// ReadAtomic is the number of RDMA READs in flight as initiator and as
	// responder (max_rd_atomic, max_dest_rd_atomic). Both peers must use the same
	// value; it is clamped to the device's limits.
	ReadAtomic int
	// Poll selects how completions are awaited; SpinTime bounds PollHybrid.
	Poll     PollStrategy
	SpinTime time.Duration
	// Timeout is the local ACK timeout exponent: 4.096 us * 2^Timeout.
	Timeout uint8
	// RetryCount is how often a request is retried on ACK timeout (0..7).
	RetryCount uint8
	// RNRRetry is how often a request is retried on receiver-not-ready (0..7,
	// 7 means forever).
	RNRRetry uint8
	// MinRNRTimer is the receiver-not-ready NAK timer code (0..31).
	MinRNRTimer uint8
	// DrainTimeout bounds the wait for flushed completions after a read fails or
	// is cancelled, before the read gives up on the queue pair.
	DrainTimeout time.Duration
}

// DefaultConfig returns the configuration for a typical single-port HCA.
func DefaultConfig() Config {
	return Config{
		Device:   "", // the first device: hosts usually have one RDMA NIC per rail
		Port:     1,  // verbs numbers ports from 1; single-port NICs have only 1
		GIDIndex: 0,  // entry 0 exists on every port; RoCE v2 deployments pick theirs with show_gids
		MTU:      4096,
		// 64 WRs of 1 MiB keep 64 MiB in flight: far above the bandwidth-delay
		// product of a 400 Gb/s link, yet a small send queue and CQ.
		QueueDepth: 64,
		// 1 MiB amortises the per-WR cost and keeps chunk completions fine-grained.
		MaxWR: 1 << 20,
		// 16 is the max_qp_rd_atom of current Mellanox/NVIDIA HCAs.
		ReadAtomic:   16,
		Poll:         PollEvent, // never burn a core waiting for the NIC
		SpinTime:     0,
		Timeout:      14, // 4.096 us * 2^14 = 67 ms before a retransmit
		RetryCount:   7,  // the most the spec allows: ride out switch hiccups
		RNRRetry:     6,  // RDMA READ never hits RNR; finite so a bug cannot hang
		MinRNRTimer:  12, // 0.64 ms, the common choice
		DrainTimeout: 5 * time.Second,
	}
}

// Validate reports the first field of c that is out of range.
func (c Config) Validate() error {
	switch {
	case c.Port == 0:
		return fmt.Errorf("%w: port must be >= 1", ErrBadConfig)
	case c.GIDIndex < -1 || c.GIDIndex > 255:
		return fmt.Errorf("%w: gid index %d not in [-1, 255]", ErrBadConfig, c.GIDIndex)
	case mtuCode(c.MTU) == 0:
		return fmt.Errorf("%w: mtu %d is not 256, 512, 1024, 2048 or 4096", ErrBadConfig, c.MTU)
	case c.QueueDepth < 1 || c.QueueDepth > maxQueueDepth:
		return fmt.Errorf("%w: queue depth %d not in [1, %d]", ErrBadConfig, c.QueueDepth, maxQueueDepth)
	case c.MaxWR < 1 || c.MaxWR > maxWRBytes:
		return fmt.Errorf("%w: max wr %d not in [1, %d]", ErrBadConfig, c.MaxWR, int64(maxWRBytes))
	case c.ReadAtomic < 1 || c.ReadAtomic > 255:
		return fmt.Errorf("%w: read atomic %d not in [1, 255]", ErrBadConfig, c.ReadAtomic)
	case c.Poll != PollEvent && c.Poll != PollHybrid:
		return fmt.Errorf("%w: unknown poll strategy %d", ErrBadConfig, c.Poll)
	case c.Poll == PollEvent && c.SpinTime != 0:
		return fmt.Errorf("%w: spin time %v set with the event poll strategy", ErrBadConfig, c.SpinTime)
	case c.Poll == PollHybrid && (c.SpinTime <= 0 || c.SpinTime > maxSpinTime):
		return fmt.Errorf("%w: spin time %v not in (0, %v]", ErrBadConfig, c.SpinTime, maxSpinTime)
	case c.Timeout > 31:
		return fmt.Errorf("%w: timeout exponent %d > 31", ErrBadConfig, c.Timeout)
	case c.RetryCount > 7:
		return fmt.Errorf("%w: retry count %d > 7", ErrBadConfig, c.RetryCount)
	case c.RNRRetry > 7:
		return fmt.Errorf("%w: rnr retry %d > 7", ErrBadConfig, c.RNRRetry)
	case c.MinRNRTimer > 31:
		return fmt.Errorf("%w: min rnr timer %d > 31", ErrBadConfig, c.MinRNRTimer)
	case c.DrainTimeout <= 0:
		return fmt.Errorf("%w: drain timeout must be > 0", ErrBadConfig)
	}
	return nil
}

// deviceLimits is what the device and port report (ibv_query_device,
// ibv_query_port) that bounds a Config.
type deviceLimits struct {
	MaxQPWR       int   // max_qp_wr
	MaxCQE        int   // max_cqe
	MaxRdAtom     int   // max_qp_rd_atom: reads in flight as responder
	MaxInitRdAtom int   // max_qp_init_rd_atom: reads in flight as initiator
	MaxMsg        int64 // max_msg_sz of the port
	ActiveMTU     uint8 // active_mtu of the port (ibv_mtu code)
}

// clampTo lowers the fields of c that exceed l. A limit the device reports as
// zero (or less) is ignored rather than allowed to turn a field into zero.
func (c Config) clampTo(l deviceLimits) Config {
	if l.MaxQPWR > 0 && c.QueueDepth > l.MaxQPWR {
		c.QueueDepth = l.MaxQPWR
	}
	if l.MaxCQE > 1 && c.QueueDepth+1 > l.MaxCQE {
		c.QueueDepth = l.MaxCQE - 1
	}
	if l.MaxMsg > 0 && c.MaxWR > l.MaxMsg {
		c.MaxWR = l.MaxMsg
	}
	for _, m := range []int{l.MaxRdAtom, l.MaxInitRdAtom} {
		if m > 0 && c.ReadAtomic > m {
			c.ReadAtomic = m
		}
	}
	if l.ActiveMTU != 0 && l.ActiveMTU < mtuCode(c.MTU) {
		c.MTU = mtuBytes(l.ActiveMTU)
	}
	return c
}

// mtuCode maps an MTU in bytes to its ibv_mtu code (IBV_MTU_256 = 1 ...
// IBV_MTU_4096 = 5), or 0 for a size verbs does not know.
func mtuCode(bytes int) uint8 {
	switch bytes {
	case 256:
		return 1
	case 512:
		return 2
	case 1024:
		return 3
	case 2048:
		return 4
	case 4096:
		return 5
	}
	return 0
}

// mtuBytes is the inverse of mtuCode; 0 for an unknown code.
func mtuBytes(code uint8) int {
	if code < 1 || code > 5 {
		return 0
	}
	return 128 << code
}
