package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// ProducerCommand is the default producer command: this binary's hidden
// `bench producer` subcommand.
func ProducerCommand() []string {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	return []string{exe, "bench", "producer"}
}

// child is a producer process driven over its stdin and stdout. Only the
// goroutine running the benchmark calls it.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  *bufio.Scanner
	stderr *tailBuffer
	hello  hello
	waited chan struct{} // closed when cmd.Wait returned
	err    error         // cmd.Wait's result, set before waited closes
}

// startChild starts argv with env appended to the environment, sends it
// start and reads its hello. The child is killed if ctx ends and, through Pdeathsig, if
// this process dies; it exits by itself when its stdin closes.
func startChild(ctx context.Context, argv, env []string, start request) (_ *child, err error) {
	if len(argv) == 0 {
		return nil, errors.New("bench: empty producer command")
	}
	c := &child{stderr: &tailBuffer{max: 64 << 10}, waited: make(chan struct{})}
	c.cmd = exec.CommandContext(ctx, argv[0], argv[1:]...)
	c.cmd.Env = append(os.Environ(), env...)
	c.cmd.Stderr = c.stderr
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	c.cmd.WaitDelay = 5 * time.Second
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		return nil, fmt.Errorf("bench: producer stdin: %w", err)
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("bench: producer stdout: %w", err)
	}
	if err := c.cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start producer %s: %w", argv[0], err)
	}
	go func() {
		c.err = c.cmd.Wait()
		close(c.waited)
	}()
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	c.lines = bufio.NewScanner(stdout)
	c.lines.Buffer(make([]byte, 4096), maxLine)
	start.Op = opStart
	if err := c.send(start); err != nil {
		return nil, err
	}
	if err := c.read(&c.hello); err != nil {
		return nil, c.failed("start", err)
	}
	if c.hello.V != protoVersion {
		return nil, fmt.Errorf("bench: producer speaks protocol %d, want %d", c.hello.V, protoVersion)
	}
	return c, nil
}

// read decodes the child's next stdout line into v.
func (c *child) read(v any) error {
	if !c.lines.Scan() {
		if err := c.lines.Err(); err != nil {
			return err
		}
		return io.EOF
	}
	return json.Unmarshal(c.lines.Bytes(), v)
}

// send writes q to the child.
func (c *child) send(q request) error {
	b, err := json.Marshal(q)
	if err != nil {
		return err
	}
	if _, err := c.stdin.Write(append(b, '\n')); err != nil {
		return c.failed(q.Op, err)
	}
	return nil
}

// call sends q and returns the child's answer.
func (c *child) call(q request) (response, error) {
	if err := c.send(q); err != nil {
		return response{}, err
	}
	var resp response
	if err := c.read(&resp); err != nil {
		return response{}, c.failed(q.Op, err)
	}
	if resp.Err != "" {
		return response{}, fmt.Errorf("bench: producer: %s: %s", q.Op, resp.Err)
	}
	return resp, nil
}

// failed wraps err with the child's exit status and the tail of its stderr.
func (c *child) failed(what string, err error) error {
	select {
	case <-c.waited:
		return fmt.Errorf("bench: producer %s: %w (producer exited: %v)\nproducer stderr:\n%s", what, err, c.err, c.stderr.String())
	case <-time.After(time.Second):
		return fmt.Errorf("bench: producer %s: %w\nproducer stderr:\n%s", what, err, c.stderr.String())
	}
}

// close asks the child to quit, closes its stdin and waits for it, killing it
// after a grace period. It returns the child's failure, with its stderr.
func (c *child) close() error {
	c.send(request{Op: opQuit})
	c.stdin.Close()
	select {
	case <-c.waited:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-c.waited
	}
	if c.err != nil {
		return fmt.Errorf("bench: producer: %w\nproducer stderr:\n%s", c.err, c.stderr.String())
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	max int

	mu sync.Mutex
	// mu guards the field below.
	b []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}
