package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"time"
)

// SystemPython is the interpreter the engine workers run under: Debian's,
// which sees the python3-numpy, python3-msgpack and python3-torch packages
// (scripts/install-deps.sh), where a pyenv python3 first on PATH does not.
const SystemPython = "/usr/bin/python3"

// PythonWorkerMissing says why the Python engine workers cannot run here
// ("" when they can): the interpreter or one of modules is missing.
func PythonWorkerMissing(modules ...string) string {
	if _, err := os.Stat(SystemPython); err != nil {
		return SystemPython + " not found (scripts/install-deps.sh installs it)"
	}
	for _, m := range append([]string{"numpy", "msgpack"}, modules...) {
		if err := exec.Command(SystemPython, "-c", "import "+m).Run(); err != nil {
			return fmt.Sprintf("%s cannot import %s (scripts/install-deps.sh installs python3-%s)", SystemPython, m, m)
		}
	}
	return ""
}

// WorkerScript is the path of a reference worker of sdk/python/workers.
func WorkerScript(name string) string {
	_, here, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(here), "..", "sdk", "python", "workers", name)
}

// Worker is an engine worker process.
type Worker struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{}
	err   error
}

// StartWorker runs script (with args) under SystemPython, connected to the
// engine socket, its output going to log.
func StartWorker(script, socket string, log io.Writer, args ...string) (*Worker, error) {
	cmd := exec.Command(SystemPython, append([]string{script, "--socket", socket}, args...)...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1", "OMP_NUM_THREADS=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	w := &Worker{cmd: cmd, stdin: stdin, done: make(chan struct{})}
	go func() {
		w.err = cmd.Wait()
		close(w.done)
	}()
	return w, nil
}

// Control writes a line to the worker's standard input: a command to a
// worker that reads them (the torch worker's --control).
func (w *Worker) Control(line string) error {
	_, err := io.WriteString(w.stdin, line+"\n")
	return err
}

// Pid is the worker's process id.
func (w *Worker) Pid() int { return w.cmd.Process.Pid }

// Kill sends SIGKILL and waits for the process to end.
func (w *Worker) Kill() {
	w.cmd.Process.Signal(syscall.SIGKILL)
	<-w.done
}

// Stop asks the worker to end (SIGTERM), killing it after a grace.
func (w *Worker) Stop() {
	w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
		w.Kill()
	}
}

// Done is closed when the process has ended.
func (w *Worker) Done() <-chan struct{} { return w.done }

// WaitEngine waits until registered() reports an engine, or ctx ends.
func WaitEngine(ctx context.Context, registered func() bool, changed func() <-chan struct{}) error {
	for {
		ch := changed()
		if registered() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return errors.New("testbed: no engine registered: " + ctx.Err().Error())
		}
	}
}
