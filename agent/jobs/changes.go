package jobs

// changes hands out a channel that the next change closes: how a view
// (an Inbox, a Fed) tells its readers to look again. Its owner's lock
// guards it. The channel is made only when someone waits, so a change
// nobody waits for costs nothing.
type changes struct{ ch chan struct{} }

// wait returns the channel the next notify closes.
func (c *changes) wait() <-chan struct{} {
	if c.ch == nil {
		c.ch = make(chan struct{})
	}
	return c.ch
}

// notify closes the channel wait handed out, if any.
func (c *changes) notify() {
	if c.ch != nil {
		close(c.ch)
		c.ch = nil
	}
}
