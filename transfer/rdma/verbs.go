//go:build rdma

package rdma

/*
#cgo LDFLAGS: -libverbs
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

// These verbs are macros or static inline functions in verbs.h, which cgo
// cannot call directly.
static struct ibv_device **lm_get_device_list(int *n) { return ibv_get_device_list(n); }
static int lm_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a) {
	return ibv_query_port(c, port, a);
}
static struct ibv_mr *lm_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
	return ibv_reg_mr(pd, addr, len, access);
}
static int lm_req_notify_cq(struct ibv_cq *cq) { return ibv_req_notify_cq(cq, 0); }
static int lm_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) { return ibv_poll_cq(cq, n, wc); }

// lm_get_cq_event consumes one event from the (non-blocking) completion
// channel and acknowledges it at once, so destroying the CQ never waits on
// unacknowledged events. It returns 0 or an errno (EAGAIN: no event yet).
static int lm_get_cq_event(struct ibv_comp_channel *ch) {
	struct ibv_cq *cq;
	void *ctx;
	errno = 0;
	if (ibv_get_cq_event(ch, &cq, &ctx))
		return errno ? errno : EIO;
	ibv_ack_cq_events(cq, 1);
	return 0;
}

// lm_create_qp creates an RC queue pair on cq for depth signalled sends of one
// SGE each. It never posts receives: RDMA READ needs none.
static struct ibv_qp *lm_create_qp(struct ibv_pd *pd, struct ibv_cq *cq, uint32_t depth) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.send_cq = cq;
	a.recv_cq = cq;
	a.cap.max_send_wr = depth;
	a.cap.max_recv_wr = 1;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 1;
	return ibv_create_qp(pd, &a);
}

// lm_qp_attr is a flat, pointer-free copy of the Go QPAttrs, so Go can fill
// it without touching the unions of struct ibv_qp_attr.
typedef struct {
	int mask, state;
	uint16_t pkey_index;
	uint8_t port;
	uint32_t access;
	uint16_t dlid;
	uint8_t av_port, global, sgid_index, hop_limit;
	uint8_t dgid[16];
	uint8_t path_mtu;
	uint32_t dest_qpn, rq_psn;
	uint8_t max_dest_rd_atomic, min_rnr_timer;
	uint8_t timeout, retry_cnt, rnr_retry;
	uint32_t sq_psn;
	uint8_t max_rd_atomic;
} lm_qp_attr;

static int lm_modify_qp(struct ibv_qp *qp, const lm_qp_attr *in) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = in->state;
	a.pkey_index = in->pkey_index;
	a.port_num = in->port;
	a.qp_access_flags = in->access;
	a.ah_attr.dlid = in->dlid;
	a.ah_attr.port_num = in->av_port;
	a.ah_attr.is_global = in->global;
	if (in->global) {
		memcpy(a.ah_attr.grh.dgid.raw, in->dgid, 16);
		a.ah_attr.grh.sgid_index = in->sgid_index;
		a.ah_attr.grh.hop_limit = in->hop_limit;
	}
	a.path_mtu = in->path_mtu;
	a.dest_qp_num = in->dest_qpn;
	a.rq_psn = in->rq_psn;
	a.max_dest_rd_atomic = in->max_dest_rd_atomic;
	a.min_rnr_timer = in->min_rnr_timer;
	a.timeout = in->timeout;
	a.retry_cnt = in->retry_cnt;
	a.rnr_retry = in->rnr_retry;
	a.sq_psn = in->sq_psn;
	a.max_rd_atomic = in->max_rd_atomic;
	return ibv_modify_qp(qp, &a, in->mask);
}

typedef struct {
	uint64_t id, laddr, raddr;
	uint32_t len;
} lm_read;

// lm_post_reads chains n signalled RDMA READs in the C-allocated wrs and sges
// and posts them. *posted is how many the QP accepted.
static int lm_post_reads(struct ibv_qp *qp, struct ibv_send_wr *wrs, struct ibv_sge *sges,
		const lm_read *r, int n, uint32_t lkey, uint32_t rkey, int *posted) {
	for (int i = 0; i < n; i++) {
		memset(&wrs[i], 0, sizeof wrs[i]);
		sges[i].addr = r[i].laddr;
		sges[i].length = r[i].len;
		sges[i].lkey = lkey;
		wrs[i].wr_id = r[i].id;
		wrs[i].sg_list = &sges[i];
		wrs[i].num_sge = 1;
		wrs[i].opcode = IBV_WR_RDMA_READ;
		wrs[i].send_flags = IBV_SEND_SIGNALED;
		wrs[i].wr.rdma.remote_addr = r[i].raddr;
		wrs[i].wr.rdma.rkey = rkey;
		wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
	}
	struct ibv_send_wr *bad = NULL;
	int rc = ibv_post_send(qp, wrs, &bad);
	*posted = rc == 0 ? n : (bad ? (int)(bad - wrs) : 0);
	return rc;
}
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// The pure-Go mirrors of verbs constants must equal them: a mismatch makes the
// constant index below out of range, which fails the build.
var _ = [1]struct{}{}[uint32(AttrState)^uint32(C.IBV_QP_STATE)|
	uint32(AttrAccessFlags)^uint32(C.IBV_QP_ACCESS_FLAGS)|
	uint32(AttrPKeyIndex)^uint32(C.IBV_QP_PKEY_INDEX)|
	uint32(AttrPort)^uint32(C.IBV_QP_PORT)|
	uint32(AttrAV)^uint32(C.IBV_QP_AV)|
	uint32(AttrPathMTU)^uint32(C.IBV_QP_PATH_MTU)|
	uint32(AttrTimeout)^uint32(C.IBV_QP_TIMEOUT)|
	uint32(AttrRetryCnt)^uint32(C.IBV_QP_RETRY_CNT)|
	uint32(AttrRNRRetry)^uint32(C.IBV_QP_RNR_RETRY)|
	uint32(AttrRQPSN)^uint32(C.IBV_QP_RQ_PSN)|
	uint32(AttrMaxQPRdAtomic)^uint32(C.IBV_QP_MAX_QP_RD_ATOMIC)|
	uint32(AttrMinRNRTimer)^uint32(C.IBV_QP_MIN_RNR_TIMER)|
	uint32(AttrSQPSN)^uint32(C.IBV_QP_SQ_PSN)|
	uint32(AttrMaxDestRdAtomic)^uint32(C.IBV_QP_MAX_DEST_RD_ATOMIC)|
	uint32(AttrDestQPN)^uint32(C.IBV_QP_DEST_QPN)|
	uint32(StateReset)^uint32(C.IBV_QPS_RESET)|
	uint32(StateInit)^uint32(C.IBV_QPS_INIT)|
	uint32(StateRTR)^uint32(C.IBV_QPS_RTR)|
	uint32(StateRTS)^uint32(C.IBV_QPS_RTS)|
	uint32(StateError)^uint32(C.IBV_QPS_ERR)|
	AccessLocalWrite^uint32(C.IBV_ACCESS_LOCAL_WRITE)|
	AccessRemoteWrite^uint32(C.IBV_ACCESS_REMOTE_WRITE)|
	AccessRemoteRead^uint32(C.IBV_ACCESS_REMOTE_READ)|
	uint32(mtuCode(4096))^uint32(C.IBV_MTU_4096)]

const noDeviceFound = "no RDMA device found"

func available() (bool, string) {
	names, err := deviceNames()
	switch {
	case err != nil:
		return false, fmt.Sprintf("%s: %v", noDeviceFound, err)
	case len(names) == 0:
		return false, noDeviceFound
	}
	return true, "RDMA devices: " + strings.Join(names, ", ")
}

func deviceNames() ([]string, error) {
	var n C.int
	list, errno := C.lm_get_device_list(&n)
	if list == nil {
		return nil, fmt.Errorf("ibv_get_device_list: %w", errno)
	}
	defer C.ibv_free_device_list(list)
	names := make([]string, 0, int(n))
	for _, d := range unsafe.Slice(list, int(n)) {
		names = append(names, C.GoString(C.ibv_get_device_name(d)))
	}
	return names, nil
}

// verbsDevice is an open device context and its protection domain.
type verbsDevice struct {
	devName string
	ctx     *C.struct_ibv_context
	pd      *C.struct_ibv_pd
	lid     uint16
	gid     [16]byte
	mtu     uint8 // active MTU code of the port
}

func openVerbs(cfg Config) (_ verbs, _ deviceLimits, err error) {
	var n C.int
	list, errno := C.lm_get_device_list(&n)
	if list == nil {
		return nil, deviceLimits{}, fmt.Errorf("%w: %s: ibv_get_device_list: %w", ErrNoDevice, noDeviceFound, errno)
	}
	defer C.ibv_free_device_list(list)
	if n == 0 {
		return nil, deviceLimits{}, fmt.Errorf("%w: %s", ErrNoDevice, noDeviceFound)
	}
	var dev *C.struct_ibv_device
	var names []string
	for _, d := range unsafe.Slice(list, int(n)) {
		name := C.GoString(C.ibv_get_device_name(d))
		names = append(names, name)
		if dev == nil && (cfg.Device == "" || cfg.Device == name) {
			dev = d
		}
	}
	if dev == nil {
		return nil, deviceLimits{}, fmt.Errorf("%w: device %q not among %v", ErrNoDevice, cfg.Device, names)
	}
	v := &verbsDevice{devName: C.GoString(C.ibv_get_device_name(dev))}
	// The context stays valid after ibv_free_device_list: the man page asks
	// only that devices are opened before the list is freed.
	ctx, errno := C.ibv_open_device(dev)
	if ctx == nil {
		return nil, deviceLimits{}, fmt.Errorf("%w: open %s: %w", ErrNoDevice, v.devName, errno)
	}
	v.ctx = ctx
	defer func() {
		if err != nil {
			_ = v.close()
		}
	}()

	var pa C.struct_ibv_port_attr
	if rc := C.lm_query_port(ctx, C.uint8_t(cfg.Port), &pa); rc != 0 {
		return nil, deviceLimits{}, fmt.Errorf("%w: query port %d of %s: %w", ErrNoDevice, cfg.Port, v.devName, syscall.Errno(rc))
	}
	if pa.state != C.IBV_PORT_ACTIVE {
		return nil, deviceLimits{}, fmt.Errorf("%w: port %d of %s is %s, not active", ErrNoDevice,
			cfg.Port, v.devName, C.GoString(C.ibv_port_state_str(pa.state)))
	}
	v.lid = uint16(pa.lid)
	v.mtu = uint8(pa.active_mtu)
	if cfg.GIDIndex >= 0 {
		var gid C.union_ibv_gid
		if rc := C.ibv_query_gid(ctx, C.uint8_t(cfg.Port), C.int(cfg.GIDIndex), &gid); rc != 0 {
			return nil, deviceLimits{}, fmt.Errorf("rdma: query gid %d of %s port %d: %w", cfg.GIDIndex, v.devName, cfg.Port, syscall.Errno(rc))
		}
		v.gid = *(*[16]byte)(unsafe.Pointer(&gid))
	}
	var da C.struct_ibv_device_attr
	if rc := C.ibv_query_device(ctx, &da); rc != 0 {
		return nil, deviceLimits{}, fmt.Errorf("rdma: query %s: %w", v.devName, syscall.Errno(rc))
	}
	pd, errno := C.ibv_alloc_pd(ctx)
	if pd == nil {
		return nil, deviceLimits{}, fmt.Errorf("rdma: allocate protection domain on %s: %w", v.devName, errno)
	}
	v.pd = pd
	lim := deviceLimits{
		MaxQPWR:       int(da.max_qp_wr),
		MaxCQE:        int(da.max_cqe),
		MaxRdAtom:     int(da.max_qp_rd_atom),
		MaxInitRdAtom: int(da.max_qp_init_rd_atom),
		MaxMsg:        int64(pa.max_msg_sz),
		ActiveMTU:     v.mtu,
	}
	return v, lim, nil
}

func (v *verbsDevice) name() string { return v.devName }

// regMR registers buf, which must be memory outside the Go heap (see
// Device.RegisterMemory): only its address crosses into C, and the NIC keeps
// using it after the call.
func (v *verbsDevice) regMR(buf []byte, remote bool) (region, error) {
	p := unsafe.Pointer(unsafe.SliceData(buf))
	access := C.int(C.IBV_ACCESS_LOCAL_WRITE)
	if remote {
		access |= C.IBV_ACCESS_REMOTE_READ
	}
	mr, errno := C.lm_reg_mr(v.pd, p, C.size_t(len(buf)), access)
	if mr == nil {
		return region{}, fmt.Errorf("ibv_reg_mr: %w", errno)
	}
	return region{
		addr: uint64(uintptr(mr.addr)),
		lkey: uint32(mr.lkey),
		rkey: uint32(mr.rkey),
		dereg: func() error {
			if rc := C.ibv_dereg_mr(mr); rc != 0 {
				return fmt.Errorf("ibv_dereg_mr: %w", syscall.Errno(rc))
			}
			return nil
		},
	}, nil
}

func (v *verbsDevice) close() error {
	var errs []error
	if v.pd != nil {
		if rc := C.ibv_dealloc_pd(v.pd); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv_dealloc_pd: %w", syscall.Errno(rc)))
		}
		v.pd = nil
	}
	if v.ctx != nil {
		if rc := C.ibv_close_device(v.ctx); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv_close_device: %w", syscall.Errno(rc)))
		}
		v.ctx = nil
	}
	return errors.Join(errs...)
}

// verbsQP is an RC queue pair with its completion queue and channel, and the
// C memory its work requests and completions are built in. Its methods are
// called with the owning QP's lock held.
type verbsQP struct {
	depth int
	spin  time.Duration // PollHybrid only

	ch   *C.struct_ibv_comp_channel
	evf  *os.File // a non-blocking dup of ch's fd, registered with the Go netpoller
	evrc syscall.RawConn
	cq   *C.struct_ibv_cq
	qp   *C.struct_ibv_qp

	// C memory: ibv_send_wr chains point into themselves, which Go memory
	// passed to C must not.
	wrs   *C.struct_ibv_send_wr
	sges  *C.struct_ibv_sge
	wcs   *C.struct_ibv_wc
	reads []C.lm_read
}

func (v *verbsDevice) newQP(cfg Config) (_ queue, _ QPInfo, err error) {
	q := &verbsQP{depth: cfg.QueueDepth, reads: make([]C.lm_read, cfg.QueueDepth)}
	if cfg.Poll == PollHybrid {
		q.spin = cfg.SpinTime
	}
	defer func() {
		if err != nil {
			_ = q.close()
		}
	}()
	ch, errno := C.ibv_create_comp_channel(v.ctx)
	if ch == nil {
		return nil, QPInfo{}, fmt.Errorf("ibv_create_comp_channel: %w", errno)
	}
	q.ch = ch
	fd, err := syscall.Dup(int(ch.fd))
	if err != nil {
		return nil, QPInfo{}, fmt.Errorf("dup completion channel fd: %w", err)
	}
	syscall.CloseOnExec(fd)
	// O_NONBLOCK lives on the shared open file description, so
	// ibv_get_cq_event on ch.fd returns EAGAIN instead of blocking a thread.
	if err := syscall.SetNonblock(fd, true); err != nil {
		_ = syscall.Close(fd)
		return nil, QPInfo{}, fmt.Errorf("set completion channel non-blocking: %w", err)
	}
	q.evf = os.NewFile(uintptr(fd), "rdma-completion-channel")
	if q.evrc, err = q.evf.SyscallConn(); err != nil {
		return nil, QPInfo{}, fmt.Errorf("completion channel raw conn: %w", err)
	}
	cq, errno := C.ibv_create_cq(v.ctx, C.int(cfg.QueueDepth+1), nil, ch, 0)
	if cq == nil {
		return nil, QPInfo{}, fmt.Errorf("ibv_create_cq(%d): %w", cfg.QueueDepth+1, errno)
	}
	q.cq = cq
	qp, errno := C.lm_create_qp(v.pd, cq, C.uint32_t(cfg.QueueDepth))
	if qp == nil {
		return nil, QPInfo{}, fmt.Errorf("ibv_create_qp(depth %d): %w", cfg.QueueDepth, errno)
	}
	q.qp = qp
	d := C.size_t(cfg.QueueDepth)
	q.wrs = (*C.struct_ibv_send_wr)(C.calloc(d, C.sizeof_struct_ibv_send_wr))
	q.sges = (*C.struct_ibv_sge)(C.calloc(d, C.sizeof_struct_ibv_sge))
	q.wcs = (*C.struct_ibv_wc)(C.calloc(d, C.sizeof_struct_ibv_wc))
	if q.wrs == nil || q.sges == nil || q.wcs == nil {
		return nil, QPInfo{}, fmt.Errorf("allocate work request memory: %w", syscall.ENOMEM)
	}
	info := QPInfo{LID: v.lid, QPN: uint32(qp.qp_num), GID: v.gid, MTU: v.mtu, Port: cfg.Port}
	return q, info, nil
}

func (q *verbsQP) modify(t Transition) error {
	a := t.Attrs
	c := C.lm_qp_attr{
		mask:               C.int(t.Mask),
		state:              C.int(a.State),
		pkey_index:         C.uint16_t(a.PKeyIndex),
		port:               C.uint8_t(a.Port),
		access:             C.uint32_t(a.AccessFlags),
		dlid:               C.uint16_t(a.AV.DLID),
		av_port:            C.uint8_t(a.AV.Port),
		sgid_index:         C.uint8_t(a.AV.SGIDIndex),
		hop_limit:          C.uint8_t(a.AV.HopLimit),
		path_mtu:           C.uint8_t(a.PathMTU),
		dest_qpn:           C.uint32_t(a.DestQPN),
		rq_psn:             C.uint32_t(a.RQPSN),
		max_dest_rd_atomic: C.uint8_t(a.MaxDestRdAtomic),
		min_rnr_timer:      C.uint8_t(a.MinRNRTimer),
		timeout:            C.uint8_t(a.Timeout),
		retry_cnt:          C.uint8_t(a.RetryCnt),
		rnr_retry:          C.uint8_t(a.RNRRetry),
		sq_psn:             C.uint32_t(a.SQPSN),
		max_rd_atomic:      C.uint8_t(a.MaxRdAtomic),
	}
	if a.AV.Global {
		c.global = 1
		for i, b := range a.AV.DGID {
			c.dgid[i] = C.uint8_t(b)
		}
	}
	if rc := C.lm_modify_qp(q.qp, &c); rc != 0 {
		return fmt.Errorf("ibv_modify_qp: %w", syscall.Errno(rc))
	}
	return nil
}

func (q *verbsQP) post(t readTarget, wrs []WR) (int, error) {
	if len(wrs) > q.depth {
		return 0, fmt.Errorf("post %d work requests on a queue of depth %d", len(wrs), q.depth)
	}
	for i, w := range wrs {
		q.reads[i] = C.lm_read{
			id:    C.uint64_t(w.ID),
			laddr: C.uint64_t(t.localBase + uint64(w.LocalOff)),
			raddr: C.uint64_t(w.RemoteAddr),
			len:   C.uint32_t(w.Len),
		}
	}
	var posted C.int
	rc := C.lm_post_reads(q.qp, q.wrs, q.sges, &q.reads[0], C.int(len(wrs)),
		C.uint32_t(t.lkey), C.uint32_t(t.rkey), &posted)
	if rc != 0 {
		return int(posted), fmt.Errorf("ibv_post_send: %w", syscall.Errno(rc))
	}
	return len(wrs), nil
}

// poll drains the CQ; when it is empty it arms the CQ, drains once more (a
// completion may have landed before arming) and sleeps in the netpoller on the
// completion channel until the NIC signals or ctx ends. With PollHybrid it
// first polls for up to the spin time, yielding between polls.
func (q *verbsQP) poll(ctx context.Context, out []completion) (int, error) {
	out = out[:min(len(out), q.depth)]
	for {
		if n, err := q.drain(out); n > 0 || err != nil {
			return n, err
		}
		if q.spin > 0 {
			for deadline := time.Now().Add(q.spin); time.Now().Before(deadline); {
				runtime.Gosched()
				if n, err := q.drain(out); n > 0 || err != nil {
					return n, err
				}
			}
		}
		if rc := C.lm_req_notify_cq(q.cq); rc != 0 {
			return 0, fmt.Errorf("ibv_req_notify_cq: %w", syscall.Errno(rc))
		}
		if n, err := q.drain(out); n > 0 || err != nil {
			return n, err
		}
		if err := q.waitEvent(ctx); err != nil {
			return 0, err
		}
	}
}

// drain takes up to len(out) completions off the CQ without waiting.
func (q *verbsQP) drain(out []completion) (int, error) {
	n := int(C.lm_poll_cq(q.cq, C.int(len(out)), q.wcs))
	if n < 0 {
		return 0, fmt.Errorf("ibv_poll_cq: returned %d", n)
	}
	for i, wc := range unsafe.Slice(q.wcs, n) {
		out[i] = completion{id: uint64(wc.wr_id)}
		if wc.status != C.IBV_WC_SUCCESS {
			out[i].err = fmt.Errorf("%w: wr %d: %s (status %d, vendor error %#x)", ErrCompletion,
				uint64(wc.wr_id), C.GoString(C.ibv_wc_status_str(wc.status)), int(wc.status), uint32(wc.vendor_err))
		}
	}
	return n, nil
}

// waitEvent blocks in the Go netpoller until the completion channel has an
// event, which it consumes, or ctx ends. A deadline in the past, set when ctx
// ends, wakes the wait.
func (q *verbsQP) waitEvent(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		_ = q.evf.SetReadDeadline(time.Unix(1, 0))
		close(fired)
	})
	var evErr error
	err := q.evrc.Read(func(uintptr) bool {
		switch rc := syscall.Errno(C.lm_get_cq_event(q.ch)); rc {
		case 0:
			return true
		case syscall.EAGAIN:
			return false
		default:
			evErr = fmt.Errorf("ibv_get_cq_event: %w", rc)
			return true
		}
	})
	if !stop() {
		<-fired
	}
	_ = q.evf.SetReadDeadline(time.Time{})
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	if err != nil {
		return fmt.Errorf("wait for completion event: %w", err)
	}
	return evErr
}

// close destroys what newQP created, in reverse order. Every CQ event was
// acknowledged when consumed, so ibv_destroy_cq does not wait.
func (q *verbsQP) close() error {
	var errs []error
	if q.qp != nil {
		if rc := C.ibv_destroy_qp(q.qp); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv_destroy_qp: %w", syscall.Errno(rc)))
		}
		q.qp = nil
	}
	if q.cq != nil {
		if rc := C.ibv_destroy_cq(q.cq); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv_destroy_cq: %w", syscall.Errno(rc)))
		}
		q.cq = nil
	}
	if q.evf != nil {
		errs = append(errs, q.evf.Close())
		q.evf = nil
	}
	if q.ch != nil {
		if rc := C.ibv_destroy_comp_channel(q.ch); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv_destroy_comp_channel: %w", syscall.Errno(rc)))
		}
		q.ch = nil
	}
	C.free(unsafe.Pointer(q.wrs))
	C.free(unsafe.Pointer(q.sges))
	C.free(unsafe.Pointer(q.wcs))
	q.wrs, q.sges, q.wcs = nil, nil, nil
	return errors.Join(errs...)
}
