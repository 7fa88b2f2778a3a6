// Package ent is the code ent generates from ./schema (go generate ./orm/ent), committed so that
// the example builds without running the generator.
package ent

//go:generate go run -mod=mod entgo.io/ent/cmd/ent generate ./schema
