package outbox

import "errors"

// PermanentError marks a handler's error that no retry can fix (a message that cannot be parsed,
// a reference to something that will never exist): the message is dead-lettered at once instead
// of after MaxAttempts. Return Permanent(err), or an error of your own with a method
// Permanent() bool that returns true.
type PermanentError struct {
	Err error
}

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err permanent (see PermanentError); nil stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent tells whether err, or an error it wraps, is permanent: a *PermanentError, or an
// error whose Permanent() method returns true.
func IsPermanent(err error) bool {
	var p *PermanentError
	if errors.As(err, &p) {
		return true
	}
	var marked interface{ Permanent() bool }
	return errors.As(err, &marked) && marked.Permanent()
}
