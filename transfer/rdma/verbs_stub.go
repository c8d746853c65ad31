//go:build !rdma

package rdma

import "fmt"

const notBuilt = "built without the rdma tag"

func available() (bool, string) { return false, notBuilt }

func openVerbs(Config) (verbs, deviceLimits, error) {
	return nil, deviceLimits{}, fmt.Errorf("%w: %s", ErrNoDevice, notBuilt)
}
