// Package pgserver runs a private PostgreSQL server from the locally installed binaries, for tests
// and examples that should work with zero set-up on a machine where PostgreSQL is installed
// (Debian: apt-get install postgresql).
//
// Start runs initdb (when needed) and pg_ctl start on a free 127.0.0.1 port, with trust
// authentication for the superuser "postgres". By default the cluster lives in a temp dir that Stop
// removes; if the process dies without calling Stop (a panic, a test timeout, Ctrl-C, os.Exit), a
// detached helper process stops the server and removes the temp dir, so nothing is left running.
//
// PostgreSQL refuses to run as root: when the process runs as root, every server command runs as the
// OS user "postgres" (created by the Debian package) through runuser.
package pgserver
