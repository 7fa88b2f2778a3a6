package middleware

import (
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// ErrUnsafeMiddlewareOrder is returned by CheckRouter, and by the middleware for each message it
// refuses to handle because of what runs inside it (it is outbox.ErrUnsafeMiddlewareOrder).
var ErrUnsafeMiddlewareOrder = outbox.ErrUnsafeMiddlewareOrder

// CheckRouter reports, before the Router runs, middleware that breaks the outbox's guarantee by
// where it sits. Watermill runs middleware in the order it was added, Router-level and
// handler-level alike, the first added outermost; the outbox middleware must be the innermost,
// so that whatever retries, poisons or acks a message sees the outcome of a whole unit of work:
//
//   - Retry inside the outbox middleware runs the handler again in the same transaction: the
//     business change of the failed attempt is applied a second time, and its side effects are
//     sent with new UUIDs;
//   - PoisonQueue inside it acks a failed attempt and commits what the handler wrote before it
//     failed;
//   - Duplicator inside it runs the handler twice in one transaction: its writes and side
//     effects are committed twice;
//   - IgnoreErrors inside it turns an ignored failure into a success and commits what the
//     failed attempt wrote;
//   - InstantAck acks the message before anything is committed, wherever it sits;
//   - the outbox middleware applied twice fails every message (ErrNestedUnitOfWork).
//
// Wrap the handler function (Wrap, WrapConsumer), which cannot be misplaced, or add the outbox
// middleware last: on the handler (h.AddMiddleware(middleware.New(ob))) after the Router's
// middleware was added, or on the Router after the others. CheckRouter reads the
// Router's middleware list by reflection (Watermill does not export it); on a Watermill whose
// Router it cannot read, it reports nothing.
func CheckRouter(r *message.Router) error {
	if r == nil {
		return nil
	}
	v := reflect.ValueOf(r).Elem().FieldByName("middlewares")
	if !v.IsValid() || v.Kind() != reflect.Slice {
		return nil
	}
	type entry struct {
		name    string // the middleware function's name
		handler string // "" for Router-level
	}
	var all []entry
	handlers := map[string]bool{}
	for i := 0; i < v.Len(); i++ {
		m := v.Index(i)
		fn, name, level := m.FieldByName("Handler"), m.FieldByName("HandlerName"), m.FieldByName("IsRouterLevel")
		if !fn.IsValid() || fn.Kind() != reflect.Func || fn.IsNil() || !name.IsValid() || !level.IsValid() {
			return nil
		}
		e := entry{name: funcName(fn)}
		if !level.Bool() {
			e.handler = name.String()
			handlers[e.handler] = true
		}
		all = append(all, e)
	}
	var problems []string
	for h := range handlers {
		var chain []string // the middleware of handler h, outermost first
		for _, e := range all {
			if e.handler == "" || e.handler == h {
				chain = append(chain, e.name)
			}
		}
		problems = append(problems, check(h, chain)...)
	}
	// A Router-level outbox middleware applies to every handler, those without middleware of their own too.
	var routerChain []string
	for _, e := range all {
		if e.handler == "" {
			routerChain = append(routerChain, e.name)
		}
	}
	problems = append(problems, check("", routerChain)...)
	if len(problems) == 0 {
		return nil
	}
	problems = dedup(problems)
	slices.Sort(problems)
	return fmt.Errorf("%w: %s", ErrUnsafeMiddlewareOrder, strings.Join(problems, "; "))
}

// check reports the unsafe middleware in chain (outermost first).
func check(handler string, chain []string) []string {
	where := "the Router"
	if handler != "" {
		where = fmt.Sprintf("handler %q", handler)
	}
	outbox := -1
	for i, name := range chain {
		if isOutbox(name) {
			outbox = i
			break
		}
	}
	var out []string
	for i, name := range chain {
		switch kind := watermillMiddleware(name); {
		case kind == "InstantAck":
			out = append(out, fmt.Sprintf("%s: InstantAck acks messages before their unit of work commits", where))
		case outbox >= 0 && i > outbox && kind != "":
			out = append(out, fmt.Sprintf("%s: %s runs inside the outbox middleware (add the outbox middleware after it)", where, kind))
		case outbox >= 0 && i > outbox && isOutbox(name):
			// Every message would fail with ErrNestedUnitOfWork.
			out = append(out, fmt.Sprintf("%s: the outbox middleware is applied twice", where))
		}
	}
	return out
}

func funcName(fn reflect.Value) string {
	if f := runtime.FuncForPC(fn.Pointer()); f != nil {
		return f.Name()
	}
	return ""
}

// isOutbox reports whether name is an outbox middleware: New's, or a tenant.Set's, which runs New's
// of the message's member (named by string: the tenant package imports this one).
func isOutbox(name string) bool {
	return strings.HasPrefix(name, "github.com/watermill-outbox/outbox/middleware.New.") ||
		name == "github.com/watermill-outbox/outbox/tenant.(*setMiddleware).wrap-fm"
}

// watermillMiddleware names the Watermill middleware a function belongs to, or "".
func watermillMiddleware(name string) string {
	const pkg = "github.com/ThreeDotsLabs/watermill/message/router/middleware."
	if !strings.HasPrefix(name, pkg) {
		return ""
	}
	rest := strings.TrimPrefix(name, pkg)
	switch {
	case strings.HasPrefix(rest, "Retry."), strings.HasPrefix(rest, "(*Retry)."):
		return "Retry"
	case strings.HasPrefix(rest, "poisonQueue."), strings.HasPrefix(rest, "(*poisonQueue)."):
		return "PoisonQueue"
	case strings.HasPrefix(rest, "InstantAck"):
		return "InstantAck"
	case strings.HasPrefix(rest, "Duplicator"):
		return "Duplicator"
	case strings.HasPrefix(rest, "IgnoreErrors."), strings.HasPrefix(rest, "(IgnoreErrors)."), strings.HasPrefix(rest, "(*IgnoreErrors)."):
		return "IgnoreErrors"
	}
	return ""
}

func dedup(v []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range v {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}
