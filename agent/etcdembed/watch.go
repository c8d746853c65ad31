package etcdembed

import (
	"context"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"
)

// queuedWatchClient is the in-process watch transport with a queue in
// front of each stream's sends. clientv3 sends a stream's requests
// (creates, cancels) from the loop that also takes its responses, and
// etcd's server stops reading requests while the responses it queued
// wait for that loop; over the in-process pipe, which buffers nothing, a
// burst of cancellations (a Store forgetting many records at once)
// deadlocks the stream for good (etcd issues 18879 and 20716). A gRPC
// connection's flow-control windows absorb such a burst. Here Send queues
// the request and returns, and one goroutine a stream sends them in order.
type queuedWatchClient struct{ pb.WatchClient }

func (c queuedWatchClient) Watch(ctx context.Context, opts ...grpc.CallOption) (pb.Watch_WatchClient, error) {
	wc, err := c.WatchClient.Watch(ctx, opts...)
	if err != nil {
		return nil, err
	}
	q := &queuedSends{Watch_WatchClient: wc, wake: make(chan struct{}, 1)}
	go q.run(wc.Context()) // ends with the stream
	return q, nil
}

// queuedSends is a watch stream whose Send does not wait for the server.
type queuedSends struct {
	pb.Watch_WatchClient
	wake chan struct{} // signalled (never blocking) when the queue grows or closes

	mu sync.Mutex
	// mu guards the fields below.
	queue  []*pb.WatchRequest
	closed bool  // CloseSend was called: close the stream's sends once the queue is sent
	err    error // why sending stopped: every later Send returns it
}

// Send queues req; an error is the failure of an earlier send.
func (q *queuedSends) Send(req *pb.WatchRequest) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.err != nil {
		return q.err
	}
	q.queue = append(q.queue, req)
	q.signal()
	return nil
}

// CloseSend closes the stream's sends after the queued requests.
func (q *queuedSends) CloseSend() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	q.signal()
	return nil
}

func (q *queuedSends) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// run sends the queued requests in order until the stream ends.
func (q *queuedSends) run(ctx context.Context) {
	for {
		select {
		case <-q.wake:
		case <-ctx.Done():
			return
		}
		for {
			q.mu.Lock()
			if len(q.queue) == 0 {
				closed := q.closed
				q.mu.Unlock()
				if closed {
					q.Watch_WatchClient.CloseSend()
					return
				}
				break
			}
			req := q.queue[0]
			q.queue = q.queue[1:]
			q.mu.Unlock()
			if err := q.Watch_WatchClient.Send(req); err != nil {
				q.mu.Lock()
				q.err, q.queue = err, nil
				q.mu.Unlock()
				return
			}
		}
	}
}
