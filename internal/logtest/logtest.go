// Package logtest has a Watermill logger for tests that keeps what is logged at level ERROR.
package logtest

import (
	"fmt"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
)

// Errors keeps the ERROR lines ("message: error") and drops the rest. Safe for concurrent use.
type Errors struct {
	mu     sync.Mutex
	lines  []string
	fields []watermill.LogFields
}

var _ watermill.LoggerAdapter = (*Errors)(nil)

func (l *Errors) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%s: %v", msg, err))
	l.fields = append(l.fields, fields)
}

func (l *Errors) Info(string, watermill.LogFields)                 {}
func (l *Errors) Debug(string, watermill.LogFields)                {}
func (l *Errors) Trace(string, watermill.LogFields)                {}
func (l *Errors) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// Contains tells whether an ERROR line contains s.
func (l *Errors) Contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.lines {
		if strings.Contains(e, s) {
			return true
		}
	}
	return false
}

// Field returns field key of the first ERROR line that contains s ("" if none has it).
func (l *Errors) Field(s, key string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, e := range l.lines {
		if strings.Contains(e, s) {
			v, _ := l.fields[i][key].(string)
			return v
		}
	}
	return ""
}

// Lines returns the ERROR lines so far.
func (l *Errors) Lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}
