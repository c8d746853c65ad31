package testbed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// BuildBinary compiles cmd/latentmesh and cmd/latentmesh-dev into dir and
// returns the path of latentmesh; latentmesh-dev lies beside it (DevBinary).
// It runs `go build` from the module root, found from this source file.
func BuildBinary(ctx context.Context, dir string) (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("testbed: cannot locate the module root")
	}
	root := filepath.Dir(filepath.Dir(file))
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+string(filepath.Separator), "./cmd/latentmesh", "./cmd/latentmesh-dev")
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("testbed: go build: %w\n%s", err, b)
	}
	return filepath.Join(dir, "latentmesh"), nil
}

// DevBinary is the latentmesh-dev that BuildBinary left beside bin.
func DevBinary(bin string) string { return filepath.Join(filepath.Dir(bin), "latentmesh-dev") }

// Process is a latentmesh subcommand running as its own OS process, with its
// output captured for assertions.
type Process struct {
	Name   string
	cmd    *exec.Cmd
	out    *lockedBuffer
	done   chan struct{}
	err    error // set before done closes
	killed bool  // set by Kill: its exit status is expected
}

// lockedBuffer collects a process's stdout and stderr; waiters are woken on
// every write.
type lockedBuffer struct {
	mu      sync.Mutex // guards the fields below
	buf     bytes.Buffer
	changed chan struct{}
	tee     io.Writer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tee != nil {
		b.tee.Write(p)
	}
	close(b.changed)
	b.changed = make(chan struct{})
	return b.buf.Write(p)
}

func (b *lockedBuffer) snapshot() (string, <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String(), b.changed
}

// StartProcess runs bin with args. tee (may be nil) also receives its output.
func StartProcess(name, bin string, tee io.Writer, args ...string) (*Process, error) {
	return StartCommand(name, exec.Command(bin, args...), tee)
}

// StartCommand starts cmd, which must not have its output set, as a Process.
func StartCommand(name string, cmd *exec.Cmd, tee io.Writer) (*Process, error) {
	p := &Process{Name: name, out: &lockedBuffer{changed: make(chan struct{}), tee: tee}, done: make(chan struct{})}
	p.cmd = cmd
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out // a nil Env inherits ours
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("testbed: start %s: %w", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Pid is the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Output is everything the process printed so far.
func (p *Process) Output() string {
	s, _ := p.out.snapshot()
	return s
}

// WaitFor waits until the output matches re and returns the first submatch
// (or the whole match when re has no group).
func (p *Process) WaitFor(ctx context.Context, re *regexp.Regexp) (string, error) {
	for {
		s, changed := p.out.snapshot()
		if m := re.FindStringSubmatch(s); m != nil {
			return m[len(m)-1], nil
		}
		select {
		case <-changed:
		case <-p.done:
			s, _ := p.out.snapshot()
			if m := re.FindStringSubmatch(s); m != nil {
				return m[len(m)-1], nil
			}
			return "", fmt.Errorf("testbed: %s exited (%v) before printing %s; output:\n%s", p.Name, p.err, re, s)
		case <-ctx.Done():
			return "", fmt.Errorf("testbed: %s did not print %s: %w; output:\n%s", p.Name, re, ctx.Err(), s)
		}
	}
}

// Kill sends SIGKILL (kill -9) and waits for the process to be gone.
func (p *Process) Kill() {
	p.killed = true
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Pause stops the process with SIGSTOP: it keeps its sockets open but
// answers nothing, like a host that hangs (a long GC pause, a stalled disk)
// rather than one that dies. It returns once every thread of the process
// is stopped: the signal is delivered to each thread as it next runs, and
// on a loaded machine etcd answered a write sent 4 ms after kill returned
// (TestEtcdOutageOnHTTPPath, with the fuzzing beside it).
func (p *Process) Pause() error {
	if err := p.signal(syscall.SIGSTOP); err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		stopped, err := allThreadsStopped(p.cmd.Process.Pid)
		if err != nil || stopped {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testbed: %s: not stopped 5 s after SIGSTOP", p.Name)
		}
		time.Sleep(time.Millisecond)
	}
}

// allThreadsStopped reports whether every thread of process pid is in the
// stopped state ('T' in /proc/<pid>/task/<tid>/stat, or 't' when traced).
func allThreadsStopped(pid int) (bool, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false, fmt.Errorf("testbed: threads of %d: %w", pid, err)
	}
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, t.Name()))
		if err != nil {
			return false, nil // a thread that just ended: look again
		}
		// The state follows the command name, which is in parentheses
		// and may itself hold spaces or parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) {
			return false, fmt.Errorf("testbed: unreadable stat of thread %s of %d", t.Name(), pid)
		}
		if st := b[i+2]; st != 'T' && st != 't' {
			return false, nil
		}
	}
	return true, nil
}

// Resume continues a paused process (SIGCONT).
func (p *Process) Resume() error { return p.signal(syscall.SIGCONT) }

func (p *Process) signal(sig syscall.Signal) error {
	if err := p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("testbed: %s: %v: %w", p.Name, sig, err)
	}
	return nil
}

// Stop sends SIGTERM and waits up to timeout before killing.
func (p *Process) Stop(timeout time.Duration) error {
	select {
	case <-p.done:
		if p.killed {
			return nil
		}
		return p.err
	default:
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	p.cmd.Process.Signal(syscall.SIGCONT) // a paused process handles its SIGTERM only once continued
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.Kill()
		return fmt.Errorf("testbed: %s ignored SIGTERM for %v", p.Name, timeout)
	}
}

// exited reports whether the process has ended.
func (p *Process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}
