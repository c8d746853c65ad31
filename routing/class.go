package routing

import "fmt"

// Class is a priority class. Lower values are served first: every queue
// orders by class, then by deadline within a class.
type Class uint8

// The priority classes, in service order.
const (
	Interactive Class = iota // a person is waiting: single images
	Standard                 // the default
	Batch                    // offline work; aging keeps it from starving
	numClasses
)

// Classes lists every class in service order.
func Classes() []Class { return []Class{Interactive, Standard, Batch} }

var classNames = [numClasses]string{"interactive", "standard", "batch"}

func (c Class) String() string {
	if c < numClasses {
		return classNames[c]
	}
	return fmt.Sprintf("class(%d)", uint8(c))
}

// Valid reports whether c is one of the defined classes.
func (c Class) Valid() bool { return c < numClasses }

// ParseClass turns a class name into a Class; "" means Standard.
func ParseClass(s string) (Class, error) {
	if s == "" {
		return Standard, nil
	}
	for i, n := range classNames {
		if n == s {
			return Class(i), nil
		}
	}
	return 0, fmt.Errorf("routing: unknown priority class %q (want interactive, standard or batch)", s)
}

// MarshalText writes the class name, so JSON records stay readable in etcdctl.
func (c Class) MarshalText() ([]byte, error) {
	if !c.Valid() {
		return nil, fmt.Errorf("routing: invalid class %d", uint8(c))
	}
	return []byte(c.String()), nil
}

// UnmarshalText parses a class name.
func (c *Class) UnmarshalText(b []byte) error {
	v, err := ParseClass(string(b))
	if err != nil {
		return err
	}
	*c = v
	return nil
}
