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
type AlarmWatcher struct {
	cli   *clientv3.Client
	every time.Duration
	log   *zap.Logger
	now   func() time.Time
	kick  chan struct{} // Observe asks Run for a poll now; buffered 1
	// health, when set, is told of every poll's outcome (ReportTo).
	health *Health

	mu          sync.Mutex // guards the fields below
	noSpace     error      // nil, or wraps ErrNoSpace
	observed    uint64     // counts Observe calls that saw NOSPACE
	lastErrLog  time.Time  // when a poll error was last logged
	errsSkipped int        // poll errors not logged since lastErrLog
	lastContact time.Time  // when a poll last got an answer (construction time before the first)
	lastErr     error      // the last poll's error, nil after an answer
}

// defaultAlarmEvery replaces a non-positive poll period.
const defaultAlarmEvery = 5 * time.Second

// NewAlarmWatcher watches cli's cluster, polling every `every` (5s if not
// positive) once Run runs. log may be nil.
func NewAlarmWatcher(cli *clientv3.Client, every time.Duration, log *zap.Logger) *AlarmWatcher {
	if log == nil {
		log = zap.NewNop()
	}
	if every <= 0 {
		every = defaultAlarmEvery
	}
	return &AlarmWatcher{
		cli:         cli,
		every:       every,
		log:         log.Named("alarms"),
		now:         time.Now,
		kick:        make(chan struct{}, 1),
		lastContact: time.Now(), // the caller just reached etcd, or will say so itself
	}
}

// pollTimeout is how long one poll waits for etcd: about until the next
// poll is due, but at least two seconds, so that a busy etcd (an alarm list
// goes through raft) is not taken for an unreachable one.
func (w *AlarmWatcher) pollTimeout() time.Duration {
	return min(max(w.every, 2*time.Second), 5*time.Second)
}

// UnreachableAfter is how long etcd may go without answering a poll before
// Unreachable reports it: one missed poll, and the one after it timing out.
func (w *AlarmWatcher) UnreachableAfter() time.Duration { return w.every + w.pollTimeout() }

// LastContact is when a poll last got an answer from etcd.
func (w *AlarmWatcher) LastContact() time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastContact
}

// Unreachable is nil while etcd answered a poll within UnreachableAfter,
// else an error wrapping ErrUnavailable with the last poll's error. It
// costs no etcd call, so a request path can refuse at once.
func (w *AlarmWatcher) Unreachable() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	age := w.now().Sub(w.lastContact)
	if age <= w.UnreachableAfter() {
		return nil
	}
	why := "no answer"
	if w.lastErr != nil {
		why = w.lastErr.Error()
	}
	return fmt.Errorf("%w: no answer for %v (%s)", ErrUnavailable, age.Round(100*time.Millisecond), why)
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

// Run polls etcd's alarm list now, every `every`, whenever Observe saw a
// NOSPACE error, and whenever the health it reports to changes (so that
// Unreachable clears as soon as etcd is back), until ctx is done. The
// caller owns the goroutine.
func (w *AlarmWatcher) Run(ctx context.Context) {
	ticker := time.NewTicker(w.every)
	defer ticker.Stop()
	for {
		var changed <-chan struct{}
		if w.health != nil {
			changed = w.health.Changed() // before the poll, whose answer may change it
		}
		w.poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		case <-w.kick:
		case <-changed:
		}
	}
}

// ReportTo makes every poll tell h whether etcd answered: an idle agent,
// which calls etcd for nothing else, learns of an outage from its poll.
// Call it before Run.
func (w *AlarmWatcher) ReportTo(h *Health) { w.health = h }

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
	timedOut := pctx.Err() != nil
	cancel()
	if w.health != nil && ctx.Err() == nil {
		// An alarm list is answered only with quorum.
		if err != nil && timedOut {
			w.health.Observe(fmt.Errorf("%w: alarm poll: no answer within %v: %v", ErrUnavailable, w.pollTimeout(), err))
		} else {
			w.health.Observe(err)
		}
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		if w.lastErr == nil {
			w.log.Warn("etcd did not answer the alarm poll", zap.Time("last_contact", w.lastContact), zap.Error(err))
		}
		w.lastErr = err
		if now := w.now(); now.Sub(w.lastErrLog) >= alarmPollErrorEvery {
			w.log.Warn("cannot read etcd alarms; keeping the last state",
				zap.Bool("no_space", w.noSpace != nil), zap.Int("errors_not_logged", w.errsSkipped), zap.Error(err))
			w.lastErrLog, w.errsSkipped = now, 0
		} else {
			w.errsSkipped++
		}
		return
	}
	if w.lastErr != nil {
		w.log.Info("etcd answers again", zap.Duration("silent_for", w.now().Sub(w.lastContact)))
	}
	w.lastContact, w.lastErr = w.now(), nil
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
