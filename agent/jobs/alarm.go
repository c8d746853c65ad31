package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var (
	// ErrNoSpace means etcd raised its NOSPACE alarm: the agent refuses new jobs
	// until an operator frees space and disarms it.
	ErrNoSpace = errors.New("jobs: etcd database is full")
	// ErrUnavailable means etcd did not answer in time or could not be
	// reached: a client should retry later, the work is not lost.
	ErrUnavailable = errors.New("jobs: etcd unreachable")
)

// noSpaceDesc is how etcd's NOSPACE error reads on the wire, for errors that
// were flattened to text on their way here.
var noSpaceDesc = rpctypes.ErrorDesc(rpctypes.ErrGRPCNoSpace)

// alarmPollErrorEvery bounds how often a failing poll (etcd unreachable) is
// logged.
const alarmPollErrorEvery = time.Minute

// AlarmWatcher reports whether etcd raised its NOSPACE alarm (the database
// hit its quota; etcd then refuses every write but deletes).
//
// It reads the alarm list only after a write was refused with NOSPACE, and
// then every `every` until the alarm is gone: an alarm list is a raft
// proposal, and an agent polling it all the time cost etcd 0.2 proposals
// a second per idle agent. So an agent learns of a full etcd from the
// first of its writes that etcd refuses (which answers its client 503
// either way), and of the disarm within a poll.
type AlarmWatcher struct {
	cli   *clientv3.Client
	every time.Duration
	log   *zap.Logger
	now   func() time.Time
	kick  chan struct{} // Observe asks Run for a poll now; buffered 1

	mu          sync.Mutex // guards the fields below
	noSpace     error      // nil, or wraps ErrNoSpace
	observed    uint64     // counts Observe calls that saw NOSPACE
	lastErrLog  time.Time  // when a poll error was last logged
	errsSkipped int        // poll errors not logged since lastErrLog
	failing     bool       // the last poll got no answer
}

// defaultAlarmEvery replaces a non-positive poll period.
const defaultAlarmEvery = 5 * time.Second

// NewAlarmWatcher watches cli's cluster, polling every `every` (5s if not
// positive) while the alarm is raised, once Run runs. log may be nil.
func NewAlarmWatcher(cli *clientv3.Client, every time.Duration, log *zap.Logger) *AlarmWatcher {
	if log == nil {
		log = zap.NewNop()
	}
	if every <= 0 {
		every = defaultAlarmEvery
	}
	return &AlarmWatcher{
		cli:   cli,
		every: every,
		log:   log.Named("alarms"),
		now:   time.Now,
		kick:  make(chan struct{}, 1),
	}
}

// pollTimeout is how long one poll waits for etcd: about until the next
// poll is due, but at least two seconds, so that a busy etcd (an alarm list
// goes through raft) is not taken for an unreachable one.
func (w *AlarmWatcher) pollTimeout() time.Duration {
	return min(max(w.every, 2*time.Second), 5*time.Second)
}

// IsUnavailable reports whether err says etcd could not be reached or did
// not answer in time (as opposed to refusing the request). A caller's own
// context.DeadlineExceeded is not included: only the caller knows whether
// its deadline was etcd's to meet.
func IsUnavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrUnavailable) {
		return true
	}
	for _, e := range []error{rpctypes.ErrTimeout, rpctypes.ErrTimeoutDueToLeaderFail,
		rpctypes.ErrTimeoutDueToConnectionLost, rpctypes.ErrNoLeader, rpctypes.ErrLeaderChanged} {
		if errors.Is(err, e) || errors.Is(rpctypes.Error(err), e) {
			return true
		}
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	case codes.Unknown:
		// A member without a leader holds a write until the request's
		// deadline (the caller's, passed on by gRPC, or its own request
		// timeout) and answers with that context's bare error, which gRPC
		// sends as Unknown. The caller's own expired context never gets
		// here: the client returns ctx.Err() for it.
		var se interface{ GRPCStatus() *status.Status }
		return errors.As(err, &se) && se.GRPCStatus().Message() == context.DeadlineExceeded.Error()
	}
	return false
}

// Run polls etcd's alarm list whenever Observe saw a NOSPACE error, and
// every `every` while the alarm is raised, until ctx is done. The caller
// owns the goroutine.
func (w *AlarmWatcher) Run(ctx context.Context) {
	ticker := time.NewTicker(w.every)
	defer ticker.Stop()
	for {
		var tick <-chan time.Time
		if w.NoSpace() != nil {
			tick = ticker.C // raised: poll until it clears
		}
		select {
		case <-ctx.Done():
			return
		case <-tick:
		case <-w.kick:
		}
		w.poll(ctx)
	}
}

// NoSpace is nil, or an error wrapping ErrNoSpace that says what to do.
func (w *AlarmWatcher) NoSpace() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.noSpace
}

// Observe takes the error of a failed write: a NOSPACE refusal marks the
// database full at once, without waiting for the next poll, and asks Run for
// a poll to confirm it.
func (w *AlarmWatcher) Observe(err error) {
	if !IsNoSpace(err) {
		return
	}
	w.mu.Lock()
	w.observed++
	if w.noSpace == nil {
		w.noSpace = noSpaceError("a write was refused: NOSPACE")
		w.log.Warn("etcd database is full: refusing new jobs", zap.Error(err))
	}
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default: // a poll is already due
	}
}

// IsNoSpace reports whether err is etcd refusing a write because its
// database is full, whether it arrives as etcd's typed error, as a gRPC
// status, or flattened to text.
func IsNoSpace(err error) bool {
	if err == nil {
		return false
	}
	return errors.Is(err, ErrNoSpace) ||
		errors.Is(err, rpctypes.ErrNoSpace) ||
		errors.Is(rpctypes.Error(err), rpctypes.ErrNoSpace) ||
		strings.Contains(err.Error(), noSpaceDesc)
}

func noSpaceError(why string) error {
	return fmt.Errorf("%w (%s): compact and defragment it, then disarm the alarm (etcdctl alarm disarm); see docs/etcd.md", ErrNoSpace, why)
}

// poll reads the alarm list once. A failed poll keeps the last state.
func (w *AlarmWatcher) poll(ctx context.Context) {
	w.mu.Lock()
	observed := w.observed
	w.mu.Unlock()

	pctx, cancel := context.WithTimeout(ctx, w.pollTimeout())
	resp, err := w.cli.AlarmList(pctx)
	cancel()

	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		w.failing = true
		if now := w.now(); now.Sub(w.lastErrLog) >= alarmPollErrorEvery {
			w.log.Warn("cannot read etcd alarms; keeping the last state",
				zap.Bool("no_space", w.noSpace != nil), zap.Int("errors_not_logged", w.errsSkipped), zap.Error(err))
			w.lastErrLog, w.errsSkipped = now, 0
		} else {
			w.errsSkipped++
		}
		return
	}
	if w.failing {
		w.log.Info("etcd answers the alarm poll again")
	}
	w.failing = false
	for _, a := range resp.Alarms {
		if a.Alarm == etcdserverpb.AlarmType_NOSPACE {
			if w.noSpace == nil {
				w.log.Warn("etcd NOSPACE alarm raised: refusing new jobs", zap.String("member", fmt.Sprintf("%x", a.MemberID)))
			}
			w.noSpace = noSpaceError(fmt.Sprintf("NOSPACE alarm raised on member %x", a.MemberID))
			return
		}
	}
	// A write refused while this poll was in flight outranks its answer,
	// which may predate the alarm; the poll Observe asked for decides.
	if w.noSpace != nil && w.observed == observed {
		w.log.Info("etcd NOSPACE alarm cleared: accepting jobs again")
		w.noSpace = nil
	}
}
