package rdma

import "fmt"

// QPState is a queue pair state. The values are those of enum ibv_qp_state.
type QPState uint8

// Queue pair states.
const (
	StateReset QPState = 0
	StateInit  QPState = 1
	StateRTR   QPState = 2 // ready to receive
	StateRTS   QPState = 3 // ready to send
	StateError QPState = 6
)

func (s QPState) String() string {
	switch s {
	case StateReset:
		return "RESET"
	case StateInit:
		return "INIT"
	case StateRTR:
		return "RTR"
	case StateRTS:
		return "RTS"
	case StateError:
		return "ERR"
	}
	return fmt.Sprintf("QPState(%d)", uint8(s))
}

// CanMoveTo reports whether an RC queue pair may be modified from s to next:
// the path RESET -> INIT -> RTR -> RTS, and from any state to RESET or ERR.
func (s QPState) CanMoveTo(next QPState) bool {
	switch next {
	case StateReset, StateError:
		return true
	case StateInit:
		return s == StateReset
	case StateRTR:
		return s == StateInit
	case StateRTS:
		return s == StateRTR
	}
	return false
}

// AttrMask selects the queue pair attributes a modify applies. The bits are
// those of enum ibv_qp_attr_mask (the verbs build asserts they match).
type AttrMask uint32

// Attribute mask bits.
const (
	AttrState           AttrMask = 1 << 0
	AttrAccessFlags     AttrMask = 1 << 3
	AttrPKeyIndex       AttrMask = 1 << 4
	AttrPort            AttrMask = 1 << 5
	AttrAV              AttrMask = 1 << 7 // address vector (ah_attr)
	AttrPathMTU         AttrMask = 1 << 8
	AttrTimeout         AttrMask = 1 << 9
	AttrRetryCnt        AttrMask = 1 << 10
	AttrRNRRetry        AttrMask = 1 << 11
	AttrRQPSN           AttrMask = 1 << 12
	AttrMaxQPRdAtomic   AttrMask = 1 << 13
	AttrMinRNRTimer     AttrMask = 1 << 15
	AttrSQPSN           AttrMask = 1 << 16
	AttrMaxDestRdAtomic AttrMask = 1 << 17
	AttrDestQPN         AttrMask = 1 << 20
)

// Access flags of a queue pair or memory region; the values are those of enum
// ibv_access_flags.
const (
	AccessLocalWrite  uint32 = 1 << 0
	AccessRemoteWrite uint32 = 1 << 1
	AccessRemoteRead  uint32 = 1 << 2
)

// requiredRC is the attribute set the InfiniBand spec (and ibv_modify_qp)
// requires for each RC transition on the connect path.
var requiredRC = map[[2]QPState]AttrMask{
	{StateReset, StateInit}: AttrState | AttrPKeyIndex | AttrPort | AttrAccessFlags,
	{StateInit, StateRTR}: AttrState | AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN |
		AttrMaxDestRdAtomic | AttrMinRNRTimer,
	{StateRTR, StateRTS}: AttrState | AttrTimeout | AttrRetryCnt | AttrRNRRetry | AttrSQPSN |
		AttrMaxQPRdAtomic,
	{StateRTS, StateError}: AttrState,
}

// RequiredMask returns the attributes a modify from one state to the other must
// carry, and false for a transition this package does not make.
func RequiredMask(from, to QPState) (AttrMask, bool) {
	m, ok := requiredRC[[2]QPState{from, to}]
	return m, ok
}

// AddressVector addresses the remote port (struct ibv_ah_attr).
type AddressVector struct {
	DLID      uint16
	Port      uint8 // local port
	Global    bool  // use the GRH: DGID, SGIDIndex and HopLimit apply
	DGID      [16]byte
	SGIDIndex uint8
	HopLimit  uint8
}

// QPAttrs is the subset of struct ibv_qp_attr an RC connection sets.
type QPAttrs struct {
	State           QPState
	PKeyIndex       uint16
	Port            uint8
	AccessFlags     uint32
	AV              AddressVector
	PathMTU         uint8 // ibv_mtu code
	DestQPN         uint32
	RQPSN           uint32
	MaxDestRdAtomic uint8
	MinRNRTimer     uint8
	Timeout         uint8
	RetryCnt        uint8
	RNRRetry        uint8
	SQPSN           uint32
	MaxRdAtomic     uint8
}

// Transition is one ibv_modify_qp call: the attributes named by Mask are
// applied, moving the queue pair from From to To.
type Transition struct {
	From, To QPState
	Mask     AttrMask
	Attrs    QPAttrs
}

// hopLimit is the GRH hop limit: routed RoCE v2 crosses few routers, and 64 is
// the IP default.
const hopLimit = 64

// Transitions returns the modifies that take a fresh RC queue pair from RESET
// to RTS, connected to remote. local is this queue pair's own QPInfo (its PSN
// and port MTU); cfg must be valid. The queue pair grants the peer RDMA READ
// only: it is the producer side of a pull as well as the consumer side.
func Transitions(cfg Config, local, remote QPInfo) ([]Transition, error) {
	if err := local.Validate(); err != nil {
		return nil, fmt.Errorf("rdma: local qp info: %w", err)
	}
	if err := remote.Validate(); err != nil {
		return nil, fmt.Errorf("rdma: remote qp info: %w", err)
	}
	av := AddressVector{DLID: remote.LID, Port: cfg.Port}
	if cfg.GIDIndex >= 0 && remote.GID != ([16]byte{}) {
		av.Global = true
		av.DGID = remote.GID
		av.SGIDIndex = uint8(cfg.GIDIndex)
		av.HopLimit = hopLimit
	} else if remote.LID == 0 {
		return nil, fmt.Errorf("%w: peer has no lid and gid addressing is off (gid index %d)", ErrBadMessage, cfg.GIDIndex)
	}
	pathMTU := min(mtuCode(cfg.MTU), local.MTU, remote.MTU)
	ra := uint8(cfg.ReadAtomic)

	ts := []Transition{
		{From: StateReset, To: StateInit, Attrs: QPAttrs{
			State:       StateInit,
			PKeyIndex:   0,
			Port:        cfg.Port,
			AccessFlags: AccessRemoteRead,
		}},
		{From: StateInit, To: StateRTR, Attrs: QPAttrs{
			State:           StateRTR,
			AV:              av,
			PathMTU:         pathMTU,
			DestQPN:         remote.QPN,
			RQPSN:           remote.PSN,
			MaxDestRdAtomic: ra,
			MinRNRTimer:     cfg.MinRNRTimer,
		}},
		{From: StateRTR, To: StateRTS, Attrs: QPAttrs{
			State:       StateRTS,
			Timeout:     cfg.Timeout,
			RetryCnt:    cfg.RetryCount,
			RNRRetry:    cfg.RNRRetry,
			SQPSN:       local.PSN,
			MaxRdAtomic: ra,
		}},
	}
	for i := range ts {
		ts[i].Mask, _ = RequiredMask(ts[i].From, ts[i].To)
	}
	return ts, nil
}

// errorTransition moves a queue pair to ERR, which flushes every outstanding
// work request with IBV_WC_WR_FLUSH_ERR.
func errorTransition(from QPState) Transition {
	return Transition{From: from, To: StateError, Mask: AttrState, Attrs: QPAttrs{State: StateError}}
}
