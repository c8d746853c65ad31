package engine

import "fmt"

// MaxAdapterLen bounds an adapter's name (a LoRA-like weight delta an
// external engine loads at run time; Spec.Adapter): it travels in every
// task of a job and in the node records of the agents whose engine has it
// loaded, several of them per model.
const MaxAdapterLen = 32

// ValidAdapter reports whether name can name an adapter: 1 to
// MaxAdapterLen bytes of letters, digits and . _ -
func ValidAdapter(name string) error {
	if name == "" || len(name) > MaxAdapterLen {
		return fmt.Errorf("must be 1-%d bytes", MaxAdapterLen)
	}
	for _, c := range []byte(name) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return fmt.Errorf("%q: only letters, digits and . _ - are allowed", name)
		}
	}
	return nil
}
